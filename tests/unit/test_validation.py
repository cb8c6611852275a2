"""Registration validation for hybrid engines: each refusal names the flag that fixes it."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from hkvd.daemon.engines.validation import (
    check_chunk_size,
    check_group_kinds,
    check_mamba,
    validate_hybrid,
)
from hkvd.transport.errors import RegistrationError


@dataclass(frozen=True, slots=True)
class G:
    """A test double with only the attributes validation reads."""

    group_id: int
    kind: str
    tokens_per_block: int


def qwen3_next(n: int = 128) -> list[G]:
    # vllm-connector.md 5.B: three GDN groups + one attention group, one unified block size.
    return [G(0, "mamba", n), G(1, "mamba", n), G(2, "mamba", n), G(3, "full", n)]


def ok(**kw) -> dict:
    base = {
        "chunk_size": 256,
        "block_size": 128,
        "max_num_batched_tokens": 128,
        "mamba_cache_mode": "align",
        "groups": qwen3_next(),
    }
    return base | kw


@pytest.mark.parametrize(
    "kw",
    [
        ok(),
        ok(max_num_batched_tokens=255),  # [N, 2N): every boundary
        ok(max_num_batched_tokens=8192),  # >= 2N accepted, unlike LMCache 0.5.1-0.5.3
        ok(chunk_size=128),
        ok(groups=[G(0, "full", 16), G(1, "swa", 16)], mamba_cache_mode="none", max_num_batched_tokens=1),
        ok(chunk_size=1152, block_size=1152, max_num_batched_tokens=2048, groups=qwen3_next(1152)),
    ],
)
def test_accepts_servable_configs(kw: dict) -> None:
    validate_hybrid(**kw)


def test_chunk_not_multiple_of_block_names_flag() -> None:
    with pytest.raises(RegistrationError, match=r"multiple of vLLM's block size 128") as e:
        validate_hybrid(**ok(chunk_size=200))
    assert "--chunk-size" in str(e.value)
    assert "to 256" in str(e.value)  # the nearest valid value, ready to paste


def test_group_tokens_per_block_must_divide_chunk() -> None:
    groups = [G(0, "full", 16), G(1, "swa", 96)]
    with pytest.raises(RegistrationError, match=r"group 1 \(swa\) has 96") as e:
        check_chunk_size(256, 16, groups)
    assert "--chunk-size" in str(e.value)
    assert "multiple of 96" in str(e.value)  # lcm(16, 96)


@pytest.mark.parametrize(("chunk", "block"), [(0, 16), (-16, 16), (256, 0)])
def test_nonpositive_sizes(chunk: int, block: int) -> None:
    with pytest.raises(RegistrationError, match="must be positive") as e:
        check_chunk_size(chunk, block, [G(0, "full", 16)])
    assert ("--chunk-size" in str(e.value)) or ("upgrade the hkvd shim" in str(e.value))


def test_batched_tokens_below_block_names_flag() -> None:
    with pytest.raises(RegistrationError, match="at least one full block") as e:
        validate_hybrid(**ok(max_num_batched_tokens=127))
    assert "--max-num-batched-tokens 128" in str(e.value)


def test_batched_tokens_rule_only_for_mamba() -> None:
    check_mamba([G(0, "full", 16)], 16, 1, "none")


@pytest.mark.parametrize("mode", ["none", "all", ""])
def test_mamba_cache_mode_must_be_align(mode: str) -> None:
    with pytest.raises(RegistrationError, match="mamba_cache_mode='align'") as e:
        validate_hybrid(**ok(mamba_cache_mode=mode))
    assert "--enable-prefix-caching --mamba-cache-mode align" in str(e.value)


def test_mamba_groups_must_share_block_size() -> None:
    groups = [G(0, "mamba", 64), G(1, "mamba", 128), G(2, "full", 64)]
    with pytest.raises(RegistrationError, match=r"one physical block size; got \[64, 128\]") as e:
        validate_hybrid(**ok(block_size=64, groups=groups))
    assert "--block-size" in str(e.value)


@pytest.mark.parametrize("kind", ["cross_attention", "encoder_only"])
def test_unknown_kinds_list_supported_ones(kind: str) -> None:
    groups = [G(0, "full", 16), G(1, kind, 16), G(2, "mamba", 16)]
    with pytest.raises(RegistrationError) as e:
        validate_hybrid(**ok(groups=groups, chunk_size=256, block_size=16))
    msg = str(e.value)
    assert f"group 1: {kind!r}" in msg
    assert "full, swa, mamba" in msg
    assert "without the hkvd connector" in msg
    # The kind check runs alone: no misleading flag advice next to it.
    assert "--chunk-size" not in msg


def test_all_unknown_groups_reported_at_once() -> None:
    with pytest.raises(RegistrationError, match=r"group 0: 'cross_attention'; group 2: 'encoder_only'"):
        check_group_kinds([G(0, "cross_attention", 16), G(1, "full", 16), G(2, "encoder_only", 16)])


def test_no_groups() -> None:
    with pytest.raises(RegistrationError, match="register_kv_caches"):
        check_group_kinds([])


def test_every_problem_reported_in_one_error() -> None:
    kw = ok(chunk_size=200, mamba_cache_mode="none", max_num_batched_tokens=64)
    with pytest.raises(RegistrationError) as e:
        validate_hybrid(**kw)
    msg = str(e.value)
    for fix in ("--chunk-size", "--mamba-cache-mode align", "--max-num-batched-tokens 128"):
        assert fix in msg


def test_accepts_layout_groupspec_by_attributes() -> None:
    from hkvd.transport.layout import GroupSpec

    names = {"group_id", "kind", "tokens_per_block"}
    assert names <= set(GroupSpec.__dataclass_fields__)
