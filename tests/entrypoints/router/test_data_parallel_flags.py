"""``serve --data-parallel-size``: each replica's share of the CPUs, and the flags it inherits."""
import pytest

from pagedllm.config import EngineConfig
from pagedllm.entrypoints.cli import _build_parser, sub_parser
from pagedllm.entrypoints.router.data_parallel import child_flags, replica_cpu_flags


def test_cpu_shares_split_replicas_then_their_ranks(llama_ckpt):
    cfg = EngineConfig(model=llama_ckpt)
    assert replica_cpu_flags(cfg, 2, allowed=[0, 1, 2, 3, 4]) == [["--cpu-threads-bind", "0,1"],
                                                                  ["--cpu-threads-bind", "2,3"]]
    tp2 = EngineConfig(model=llama_ckpt, tensor_parallel_size=2)
    assert replica_cpu_flags(tp2, 2, allowed=list(range(8))) == [["--cpu-threads-bind", "0,1|2,3"],
                                                                 ["--cpu-threads-bind", "4,5|6,7"]]
    nobind = EngineConfig(model=llama_ckpt, cpu_threads_bind="nobind")
    assert replica_cpu_flags(nobind, 2, allowed=list(range(6))) == [
        ["--cpu-threads-bind", "nobind", "--cpu-threads", "3"]] * 2
    with pytest.raises(ValueError, match="needs 4 CPU cores"):
        replica_cpu_flags(tp2, 2, allowed=[0, 1, 2])
    with pytest.raises(ValueError, match="takes auto or nobind"):
        replica_cpu_flags(EngineConfig(model=llama_ckpt, cpu_threads_bind="0-1"), 2, allowed=[0, 1])


def test_children_get_the_users_flags_but_not_the_launchers():
    parser = _build_parser()
    args = parser.parse_args(["serve", "/m", "--data-parallel-size", "2", "--port", "9000", "--dtype=float32",
                              "--no-enable-prefix-caching", "--api-key", "secret", "--routing", "round_robin",
                              "--max-num-seqs", "8", "--skip-tokenizer-init", "--cpu-threads-bind", "auto"])
    flags = child_flags(sub_parser(parser, "serve"), args)
    assert flags == ["--skip-tokenizer-init", "--dtype", "float32", "--max-num-seqs", "8",
                     "--no-enable-prefix-caching"]


def test_every_serve_flag_is_spelled_after_its_dest_and_survives_the_round_trip():
    """child_flags spells a flag ``--`` + its dest; a flag added with another dest would be lost."""
    import re

    parser = _build_parser()
    serve = sub_parser(parser, "serve")
    usage = serve.format_help()
    for dest in vars(serve.parse_args([])):
        if dest != "model_pos":  # MODEL, the one positional
            flag = "--" + dest.replace("_", "-")
            assert re.search(re.escape(flag) + r"(?![\w-])", usage), f"serve's {dest} is not spelled {flag}"
    given = ["serve", "/m", "--served-model-name", "a", "b", "--access-log", "--enable-prefix-caching",
             "--no-enable-chunked-prefill", "--max-request-body-size", "8MiB", "--chat-template-timeout", "3",
             "--allowed-origins", '["x", "y"]', "--allowed-methods", "GET", "--trust-request-chat-template",
             "--seed", "5", "--structured-outputs-config", '{"backend": "xgrammar"}', "--lora-modules", "a=/p",
             "b=/q"]
    args = parser.parse_args(given)
    again = parser.parse_args(["serve", "/m", *child_flags(serve, args)])
    assert vars(again) == vars(args)
