"""Images in the prefix-cache hash chain: the blocks an image's placeholder positions overlap are
keyed by its content hash, so two different images never share KV blocks, the same image does, and
text-only blocks hash exactly as before."""
from pagedllm.core.block_hash import extend_block_hashes
from pagedllm.core.contracts import MultiModalFeature
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.sampling_params import SamplingParams

IMG = 9  # the placeholder id: the same for every image


def prompt():  # 4 text tokens, 8 image positions (4..11), 6 text tokens: blocks of 4
    return [1, 2, 3, 4] + [IMG] * 8 + [5, 6, 7, 8, 9, 10]


def feature(h: str, offset: int = 4, length: int = 8) -> MultiModalFeature:
    return MultiModalFeature(offset, length, h)


def hashes(mm, salt=None):
    out: list[bytes] = []
    extend_block_hashes(out, prompt(), 4, salt, mm)
    return out


def test_only_blocks_an_image_overlaps_change_and_the_chain_carries_it():
    plain, a, b = hashes(()), hashes([feature("aa")]), hashes([feature("bb")])
    assert a[0] == plain[0] == b[0]  # block 0 holds text only
    assert a[1] != b[1] and a[2] != b[2]  # the image's blocks
    assert a[3] != b[3]  # a text block after the image: different through the chain
    assert hashes([feature("aa")]) == a  # stable
    assert hashes((), "salt")[0] != plain[0] and hashes([feature("aa")], "salt")[1] != a[1]


def test_image_position_is_part_of_the_key():
    one, two = hashes([feature("aa", 4, 8)]), hashes([feature("aa", 4, 4), feature("aa", 8, 4)])
    assert one[1] == two[1] and one[2] != two[2]  # one 8-position image vs the same pixels twice


def _req(rid: str, h: str) -> Request:
    return Request(rid, prompt(), SamplingParams(max_tokens=4), max_tokens=4, mm_features=(feature(h),))


def test_kv_cache_hits_for_the_same_image_only():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    first = _req("a", "aa")
    kv.allocate_slots(first, first.num_tokens)
    same, other = _req("b", "aa"), _req("c", "bb")
    assert kv.get_computed_blocks(same)[1] == 16  # 18 tokens: 4 full blocks (the last token is computed)
    assert kv.get_computed_blocks(other)[1] == 4  # only the text block before the image
    kv.free(first)
    assert kv.num_free_blocks == 16
    kv.pool.check_consistency()
