"""Chat templates render bounded: oversized values refused before they are built, compiled
templates in a bounded LRU, and the sandbox process killed on timeout (the server survives)."""
import time

import pytest

from pagedllm.tokenizer.chat_template import TemplateLimitError, TemplateSandbox, compile_template, render_bounded


@pytest.mark.parametrize("template", ["{{ 'ab' * 100000000 }}", "{{ 100000000 * 'ab' }}", "{{ 9 ** 9999999 }}",
                                      "{% for i in range(10**8) %}{% endfor %}", "{% for i in range(10**5) %}"
                                      "{{ 'y' * 100 }}{% endfor %}"])
def test_in_process_bounds(template):
    with pytest.raises(TemplateLimitError):
        render_bounded(template, {}, max_output_chars=1 << 20)


def test_compiled_templates_lru_is_bounded():
    for i in range(100):
        compile_template(f"t{i} {{{{ messages }}}}")
    info = compile_template.cache_info()
    assert info.maxsize == 32 and info.currsize <= 32


def test_sandbox_kills_a_slow_template_and_keeps_serving():
    sandbox = TemplateSandbox(workers=1, timeout=0.5)
    try:
        assert sandbox.render("{{ a }}!", {"a": "hi"}) == "hi!"
        t0 = time.monotonic()
        with pytest.raises(TemplateLimitError, match="within"):
            sandbox.render("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", {})
        assert time.monotonic() - t0 < 5
        with pytest.raises(TemplateLimitError, match="MiB"):
            sandbox.render("{{ 'x' | center(2000000000) }}", {})
        with pytest.raises(ValueError, match="boom"):
            sandbox.render("{{ raise_exception('boom') }}", {})
        assert sandbox.render("{{ a }}?", {"a": "again"}) == "again?"
    finally:
        sandbox.close()
