"""Several tokens per step (speculative decoding) through the output processor: a stop string
completed by a token in the middle of the step drops the later tokens and their logprobs, the
text equals one-token-at-a-time processing; streaming deltas carry every accepted token."""
from pagedllm.core.contracts import EngineCoreOutput, Logprobs
from pagedllm.engine.output_processor import OutputProcessor, RequestState
from pagedllm.sampling_params import SamplingParams
from pagedllm.tokenizer.detokenizer import IncrementalDetokenizer
from pagedllm.tokenizer.tokenizer import load_tokenizer


def state(tok, params, prompt):
    return RequestState("r", "r", 0, None, prompt, params, IncrementalDetokenizer(tok, prompt, True))


def lp(tokens):
    return Logprobs([[t] for t in tokens], [[-0.5 * (i + 1)] for i in range(len(tokens))], [1] * len(tokens))


def test_stop_string_mid_step(llama_ckpt):
    tok = load_tokenizer(llama_ckpt)
    ids = tok.encode("w10 w11 w12 w13 w14 w15", add_special_tokens=False)
    params = SamplingParams(max_tokens=20, stop=["w12 w13"], logprobs=0)
    prompt = tok.encode("w1 w2", add_special_tokens=False)

    one = OutputProcessor(tok)
    one.add_request(state(tok, params, prompt))
    for i, t in enumerate(ids):
        st, stopped = one.process(EngineCoreOutput("r", [t], logprobs=lp([t])))
        if stopped:
            break
    many = OutputProcessor(tok)
    many.add_request(state(tok, params, prompt))
    st2, stopped2 = many.process(EngineCoreOutput("r", ids[:2], logprobs=lp(ids[:2])))
    assert not stopped2
    st2, stopped2 = many.process(EngineCoreOutput("r", ids[2:], logprobs=lp(ids[2:])))  # the stop ends at ids[3]
    assert stopped and stopped2
    assert st2.text == st.text and st2.stop_reason == "w12 w13" and st2.finish_reason == "stop"
    assert st2.token_ids == ids[:4] and len(st2.logprobs) == 4
    assert abs(st2.cumulative_logprob - (-0.5 - 1.0 - 0.5 - 1.0)) < 1e-9


def test_streaming_delta_carries_all_accepted_tokens(llama_ckpt):
    tok = load_tokenizer(llama_ckpt)
    ids = tok.encode("w20 w21 w22 w23", add_special_tokens=False)
    proc = OutputProcessor(tok)
    proc.add_request(state(tok, SamplingParams(max_tokens=20), [5]))
    st, _ = proc.process(EngineCoreOutput("r", ids[:3]))
    c = proc.completion(st, delta=True)
    assert c.token_ids == ids[:3] and c.text.split() == ["w20", "w21", "w22"]
    st, _ = proc.process(EngineCoreOutput("r", ids[3:]))
    assert proc.completion(st, delta=True).token_ids == ids[3:]
