"""Which pending handshakes the driver keeps under a flood (pure logic, explicit clock)."""

from __future__ import annotations

import random

from spark_torch.channel.handshake_slots import HandshakeSlots, normalize_address


def _slots(trusted: tuple[str, ...] = ("10.0.0.1",), **kw: int) -> HandshakeSlots[str]:
    limits = {"total": 8, "per_address": 4, "trusted_per_address": 3} | kw
    return HandshakeSlots(trusted, min_age=1.0, rng=random.Random(7), **limits)


def _fill(slots: HandshakeSlots[str], host: str, count: int, now: float, prefix: str = "") -> list[str]:
    keys = [f"{prefix or host}#{i}" for i in range(count)]
    for key in keys:
        assert slots.admit(key, host, now).admitted
    return keys


def test_strangers_cannot_take_a_trusted_address_slots() -> None:
    slots = _slots()
    for host in ("10.9.0.1", "10.9.0.2"):
        _fill(slots, host, 4, now=0.0)
    assert not slots.admit("late stranger", "10.9.0.3", 0.5).admitted  # the shared slots are full and young
    for i in range(3):
        assert slots.admit(f"node{i}", "10.0.0.1", 0.5).admitted
    assert len(slots) == 8 + 3
    assert slots.is_trusted("10.0.0.1") and not slots.is_trusted("10.9.0.1")


def test_a_handshake_under_min_age_is_never_evicted_the_newcomer_is_refused() -> None:
    slots = _slots()
    _fill(slots, "10.0.0.1", 3, now=0.0)
    refused = slots.admit("newcomer", "10.0.0.1", 0.999)
    assert not refused.admitted and refused.evict is None
    assert len(slots) == 3


def test_an_older_handshake_is_evicted_at_random_never_a_young_one() -> None:
    victims = set()
    for seed in range(40):
        slots: HandshakeSlots[str] = HandshakeSlots(
            ["10.0.0.1"], total=8, per_address=4, trusted_per_address=3, min_age=1.0, rng=random.Random(seed)
        )
        assert slots.admit("old0", "10.0.0.1", 0.0).admitted
        assert slots.admit("old1", "10.0.0.1", 0.5).admitted
        assert slots.admit("young", "10.0.0.1", 1.2).admitted
        admission = slots.admit("newcomer", "10.0.0.1", 1.6)  # old0 and old1 are a second old, young is not
        assert admission.admitted
        victims.add(admission.evict)
        assert len(slots) == 3
        slots.remove("young")  # still recorded: the victim, not it, was forgotten
    assert victims == {"old0", "old1"}


def test_one_stranger_address_is_bounded_and_evicts_only_its_own() -> None:
    slots = _slots()
    other = _fill(slots, "10.9.0.2", 2, now=0.0)
    mine = _fill(slots, "10.9.0.1", 4, now=0.0)
    assert not slots.admit("fifth", "10.9.0.1", 0.5).admitted  # its own four are young
    admission = slots.admit("fifth", "10.9.0.1", 2.0)
    assert admission.admitted and admission.evict in mine and admission.evict not in other


def test_a_flood_from_few_addresses_cannot_keep_a_new_address_out() -> None:
    """The shared slots are full of old handshakes from two flooding addresses: their own newcomers
    are refused (nobody holds more than they do), a new address gets a slot at once."""
    slots = _slots(per_address=8)
    _fill(slots, "10.9.0.1", 4, now=0.0)
    _fill(slots, "10.9.0.2", 4, now=0.0)
    assert not slots.admit("flood", "10.9.0.1", 2.0).admitted
    admission = slots.admit("node", "10.5.0.1", 2.0)
    assert admission.admitted and admission.evict is not None and admission.evict.startswith("10.9.0.")


def test_removed_handshakes_free_their_slots() -> None:
    slots = _slots()
    keys = _fill(slots, "10.0.0.1", 3, now=0.0)
    slots.remove(keys[1])
    assert slots.admit("again", "10.0.0.1", 0.1).admitted
    for key in [keys[0], keys[2], "again"]:
        slots.remove(key)
    assert len(slots) == 0


def test_addresses_are_compared_in_one_spelling() -> None:
    assert normalize_address("::ffff:10.0.0.1") == "10.0.0.1"
    assert normalize_address("[2001:db8:0::1]") == "2001:db8::1"
    assert normalize_address("fe80::1%eth0") == "fe80::1"
    assert normalize_address("not-an-address") == "not-an-address"
    assert _slots().is_trusted("::ffff:10.0.0.1")
