"""The tail shared by the Triton files' ahead-of-time compile checks (test_triton_attn.py,
test_triton_kv8.py): each check's script records the kernels' launches (``calls`` of
(kernel, args, kwargs), ``TY`` naming tensor dtypes) as the engine makes them, then this compiles
every distinct signature for sm_90 with no GPU and prints AOT-OK."""

COMPILE_RECORDED_CALLS = r"""
seen = set()
for fn, args, kw in calls:
    kw = dict(kw)
    opts = {k: kw.pop(k) for k in ("num_warps", "num_stages") if k in kw}
    sig, consts, attrs = {}, {}, {}
    bound = dict(zip(fn.arg_names, args)); bound.update(kw)
    for i, p in enumerate(fn.params):
        v = bound[p.name]
        if p.is_constexpr:
            sig[p.name] = "constexpr"; consts[p.name] = v
        elif isinstance(v, torch.Tensor):
            sig[p.name] = "*" + TY[v.dtype]; attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            sig[p.name] = "fp32"
        elif isinstance(v, int) and v == 1:
            sig[p.name] = "constexpr"; consts[p.name] = 1
        else:
            sig[p.name] = "i32"
            if v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    key = (fn.fn.__name__, repr(sorted(sig.items())), repr(sorted(consts.items())), repr(opts))
    if key in seen:
        continue
    seen.add(key)
    k = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32), options=opts)
    assert k.asm["cubin"], key
    print("compiled", fn.fn.__name__, {c: consts[c] for c in consts if c.isupper()}, "shared", k.metadata.shared, flush=True)
print("AOT-OK", len(seen))
"""
