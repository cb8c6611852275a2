"""Tenant labels (``hkvd.shim.tenants``): the salt's digest, else the LoRA adapter's name, else the unsalted
share; every label passes the wire's check, and the salt never appears in clear."""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import pytest

from hkvd.shim.tenants import lora_label, tenant
from hkvd.transport.errors import ProtocolViolation
from hkvd.transport.wire.control import MAX_TENANT, check_tenant


def req(salt: str | None = None, lora: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(cache_salt=salt, lora_request=SimpleNamespace(lora_name=lora) if lora is not None else None)


def test_a_salted_request_is_its_salts_digest_never_the_salt() -> None:
    label = tenant(req(salt="tenant-a-secret"))
    assert label == "salt:" + hashlib.blake2b(b"tenant-a-secret", digest_size=8).hexdigest()
    assert "secret" not in label and len(label) == 5 + 16
    assert tenant(req(salt="tenant-a-secret")) == label  # stable
    assert tenant(req(salt="tenant-b-secret")) != label
    assert tenant(req(salt="tenant-a-secret", lora="adapter")) == label  # the salt wins over the adapter
    check_tenant(label, "test")


def test_an_adapter_without_salt_is_its_name() -> None:
    assert tenant(req(lora="support-bot")) == "lora:support-bot"
    assert tenant(req(lora="support-bot")) != tenant(req(lora="sales-bot"))


def test_no_salt_and_no_adapter_is_the_unsalted_share() -> None:
    assert tenant(req()) == tenant(req(salt="")) == tenant(SimpleNamespace()) == ""


@pytest.mark.parametrize("name", ["x" * 59, "x" * 60, "y" * 500, "two words", "caf\u00e9", "", "tab\there"])
def test_every_adapter_name_gives_a_label_the_wire_takes(name: str) -> None:
    label = lora_label(name)
    check_tenant(label, "test")  # raises if not
    assert label.startswith("lora:") and len(label) <= MAX_TENANT


def test_long_or_unprintable_names_stay_apart() -> None:
    assert lora_label("x" * 59) == "lora:" + "x" * 59  # fits as is
    long_a, long_b = lora_label("p" * 80 + "a"), lora_label("p" * 80 + "b")
    assert long_a != long_b and long_a.startswith("lora:" + "p" * 20)
    assert lora_label("two words") != lora_label("two  words")
    with pytest.raises(ProtocolViolation):
        check_tenant("lora:two words", "test")  # why such names are digested
