"""The offline API: ``LLM.generate`` and ``LLM.chat``; with the pooling runner ``LLM.embed``,
``LLM.score``, ``LLM.encode`` and ``LLM.classify`` (entrypoints/pooling_api.py)."""
from __future__ import annotations

from typing import Any, Optional, Sequence, Union

from pagedllm.config import EngineConfig
from pagedllm.engine.beam_search import BeamSearchOutput, BeamSearchParams, to_beam_search_output
from pagedllm.engine.core_client import core_in_own_process
from pagedllm.engine.llm_engine import OUTPUT_FINAL, LLMEngine
from pagedllm.engine.pooling_engine import PoolingEngine, wants_pooling
from pagedllm.entrypoints.pooling_api import PoolingAPI
from pagedllm.heap import old_objects_frozen
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.tokenizer.tokenizer import render_chat_prompt


class LLM(PoolingAPI):
    """Offline batched generation over the paged, continuously batched engine.

    >>> llm = LLM(model="path/to/checkpoint")            # doctest: +SKIP
    >>> llm.generate(["Hello"], SamplingParams(max_tokens=8))  # doctest: +SKIP
    """

    def __init__(self, model: Optional[str] = None, skip_tokenizer_init: bool = False, **kwargs: Any) -> None:
        """``kwargs``: EngineConfig fields; ``engine_core_process=True`` runs the engine core
        (scheduler, KV cache, model) in a process of its own, as the server does (here the
        default is one process)."""
        if "kv_cache_space" in kwargs:  # vLLM CPU spelling, in GiB
            kwargs["kv_cache_memory"] = int(kwargs.pop("kv_cache_space") * 1024**3)
        config = EngineConfig(**kwargs) if model is None else EngineConfig(model=model, **kwargs)
        self.config = config
        self.pooling = None  # runner="pooling" (or an encoder architecture): embed / score / encode / classify
        if wants_pooling(config):
            self.pooling = PoolingEngine(config)
            self.engine = None
            return
        self.engine = LLMEngine(config, skip_tokenizer_init=skip_tokenizer_init,
                                multiprocess=core_in_own_process(config, server=False))

    def _generating(self) -> LLMEngine:
        if self.engine is None:
            raise ValueError("this LLM runs a pooling model (runner='pooling'): use embed / score / encode / classify, "
                             "not generation")
        return self.engine

    def get_tokenizer(self):
        return self.engine.tokenizer if self.engine is not None else self.pooling.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json recommendations (temperature,
        top_p, top_k, min_p, repetition_penalty, max_new_tokens as max_tokens) over the defaults;
        what ``generate`` and ``chat`` use when given no sampling params (EngineConfig
        generation_config="vllm" ignores the file)."""
        return SamplingParams(**self.engine.default_sampling_params)

    # ---- generation -------------------------------------------------------------------------
    def generate(
        self,
        prompts: Union[str, Sequence[Any], None] = None,
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        prompt_token_ids: Optional[Sequence[Sequence[int]]] = None,
        use_tqdm: bool = True,
        lora_request=None,
    ) -> list[RequestOutput]:
        """``lora_request``: a LoRARequest for every prompt, or a list with one (or None) per prompt."""
        self._generating()
        if prompts is None and prompt_token_ids is None:
            raise ValueError("pass prompts or prompt_token_ids")
        if prompts is not None and prompt_token_ids is not None:
            raise ValueError("pass either prompts or prompt_token_ids, not both")
        if prompts is None:
            items: list[Any] = [list(p) for p in prompt_token_ids]
        elif isinstance(prompts, (str, dict)):
            items = [prompts]
        elif prompts and all(isinstance(t, int) for t in prompts):
            items = [list(prompts)]  # a single prompt of token ids
        else:
            items = list(prompts)
        params = self._expand_params(sampling_params, len(items))
        return self._run(items, params, use_tqdm, lora_request)

    def chat(
        self,
        messages: Union[list[dict[str, Any]], list[list[dict[str, Any]]]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        use_tqdm: bool = True,
        chat_template: Optional[str] = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Optional[dict[str, Any]] = None,
        lora_request=None,
    ) -> list[RequestOutput]:
        if self.engine.tokenizer is None:
            raise ValueError("chat needs a tokenizer")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        items = [self._chat_item(conv, add_generation_prompt, chat_template, chat_template_kwargs)
                 for conv in conversations]
        return self._run(items, self._expand_params(sampling_params, len(items)), use_tqdm, lora_request)

    def _chat_item(self, conv, add_generation_prompt: bool, chat_template, chat_template_kwargs) -> dict[str, Any]:
        """One conversation's prompt: content parts flattened (an image part becomes the model's
        placeholder; its image goes to multi_modal_data), then the chat template."""
        from pagedllm.multimodal.chat_content import flatten_messages

        processor = self.engine.input_processor.images
        conv, images = flatten_messages(conv, processor.placeholder if processor is not None else None,
                                        self.engine.input_processor.media,
                                        self.engine.config.max_images_per_prompt)
        text, ids = render_chat_prompt(self.engine.tokenizer, conv, add_generation_prompt, chat_template,
                                       **(chat_template_kwargs or {}))
        item: dict[str, Any] = {"prompt_token_ids": ids, "prompt": text}  # the rendered prompt: RequestOutput.prompt
        if images:
            item["multi_modal_data"] = {"image": images}
        return item

    def _expand_params(self, sp, n: int) -> list[SamplingParams]:
        if sp is None:
            return [self.get_default_sampling_params()] * n
        if isinstance(sp, SamplingParams):
            return [sp] * n
        sp = list(sp)
        if len(sp) != n:
            raise ValueError(f"got {len(sp)} sampling params for {n} prompts")
        return sp

    def _expand_loras(self, lora_request, n: int) -> list:
        if lora_request is None or not isinstance(lora_request, (list, tuple)):
            loras = [lora_request] * n
        else:
            loras = list(lora_request)
            if len(loras) != n:
                raise ValueError(f"got {len(loras)} lora requests for {n} prompts")
        for lr in {id(lr): lr for lr in loras if lr is not None}.values():  # bad ones: ValueError before anything runs
            self.engine.resolve_lora(lr)
        return loras

    def _process_prompts(self, items: list[Any], params: Optional[list[SamplingParams]] = None) -> list[Any]:
        """Each prompt validated and tokenised (once: the engine takes the result as it is)."""
        processed = []
        for i, item in enumerate(items):
            truncate = params[i].truncate_prompt_tokens if params is not None else None
            try:
                processed.append(self.engine.input_processor.process(item, truncate))
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        return processed

    def _run(self, items: list[Any], params: list[SamplingParams], use_tqdm: bool,
             lora_request=None) -> list[RequestOutput]:
        engine = self._generating()
        loras = self._expand_loras(lora_request, len(items))
        # Validate everything before anything is queued: one bad prompt fails the call cleanly.
        items = self._process_prompts(items, params)
        for sp in dict.fromkeys(map(id, params)):  # a bad schema/regex/grammar: ValueError before anything runs
            engine.check_structured_outputs(next(p for p in params if id(p) == sp))
        ids = []
        try:
            for item, sp, lr in zip(items, params, loras):
                ids.append(engine.add_request(None, item, sp, output_kind=OUTPUT_FINAL, lora_request=lr))
        except Exception:
            engine.abort_request(ids)
            raise
        index = {rid: i for i, rid in enumerate(ids)}
        results: list[Optional[RequestOutput]] = [None] * len(ids)
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        try:
            with old_objects_frozen():
                self._step_until_done(index, results, bar)
        except BaseException:
            engine.abort_request(ids)
            raise
        finally:
            if bar is not None:
                bar.close()
        return results  # type: ignore[return-value]

    def _step_until_done(self, index: dict, results: list, bar) -> None:
        engine = self.engine
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished and out.request_id in index:
                    results[index[out.request_id]] = out
                    if bar is not None:
                        bar.update(1)

    def beam_search(self, prompts: Union[str, Sequence[Any]], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Beam search inside the engine (vLLM's call shape): per prompt, the ``beam_width`` best
        sequences (prompt + generated tokens), best score first, with their cumulative logprobs.
        Beams share KV blocks and fork with copy-on-write; HF transformers' scores and stopping."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        items = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        engine = self.engine
        items = self._process_prompts(items)
        ids: list[str] = []
        results: dict[str, RequestOutput] = {}
        try:
            for item in items:
                ids.append(engine.add_request(None, item, params, output_kind=OUTPUT_FINAL))
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        results[out.request_id] = out
        except BaseException:
            engine.abort_request(ids)
            raise
        return [to_beam_search_output(results[rid]) for rid in ids]

    # ---- cache & stats ----------------------------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()

    def get_stats(self):
        return self.engine.get_stats()

    def shutdown(self) -> None:
        """Stop the engine now: its worker processes and process group (tensor/pipeline
        parallel) go; dropping the LLM (``del llm``) does the same when it is collected."""
        self.engine.shutdown()
