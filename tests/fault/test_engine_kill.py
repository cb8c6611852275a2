"""kill -9 of an engine in the middle of a store and of a retrieve, next to a busy bystander engine.

Each test kills three victim processes, one after another, each right after ``hkvd status`` showed
its copy in flight (a store writing its entries, or a retrieve holding its lease and pins). What
must hold after each kill:

- within ``RELEASE_S`` of the victim being reaped, the daemon has dropped its registration and
  every lease, pin and half-written entry it held (the lease TTL is 600 s, so only the
  disconnect can have released them);
- whatever the victim managed to store is byte-exact when read back (a torn entry is never
  served), and a victim that only retrieved leaves the pool's free bytes exactly as they were;
- the bystander engine, storing / looking up / retrieving all along, saw no error, no miss it
  did not cause, and no wrong byte;
- at the end, with every engine gone: 0 leases, 0 pins, 0 writers, and a sweep of the pool gives
  the same figure (free bytes, entries, bytes) as the sweep before the test.
"""

from __future__ import annotations

import pytest

RELEASE_S = 1.0  # issue #8: "every pin and lease it held returns within 1 s"
ROUNDS = 3
# The bystander holds at most one lease on 2 entries, or writes 2 entries, at any moment; a victim
# holds 8 (a store job) to 16 (a retrieve) entries. More than this is the victim's.
BYSTANDER_MAX = 2


def _bystander_only(st: dict, victim_pid: int) -> bool:
    idx = st["index"]
    return (all(e["pid"] != victim_pid for e in st["engines"]) and idx["writing"] <= BYSTANDER_MAX
            and idx["pinned_entries"] <= BYSTANDER_MAX and idx["leases"] <= 1)


@pytest.mark.parametrize("phase", ["store", "retrieve"])
def test_engine_killed_mid_copy_releases_everything_and_hurts_no_one(daemon_factory, fault, tmp_path, phase):
    d = daemon_factory("--l1-size-gb", "0.25", "--chunk-size", "32", "--lease-ttl-s", "600")
    before = fault.sweep(d, seed=1)
    stop = tmp_path / "stop"
    bystander = fault.spawn(d, "bystander", "--stop-file", str(stop))
    bystander.ready()

    def in_flight(st: dict) -> bool:
        idx = st["index"]
        return idx["writing"] > BYSTANDER_MAX if phase == "store" else idx["pinned_entries"] > BYSTANDER_MAX

    release_s, caught, checked = [], 0, 0
    for r in range(ROUNDS):
        progress = tmp_path / f"progress-{r}"
        victim = fault.spawn(d, "store-stream" if phase == "store" else "retrieve-loop",
                             "--progress", str(progress))
        victim.ready()
        free_before = d.status()["pool"]["free_bytes"]
        st, _ = fault.wait_until(d, in_flight, 20)
        victim.kill()  # right after the daemon reported the victim's copy in flight
        caught += in_flight(st)
        pid = victim.proc.pid
        st, waited = fault.wait_until(d, lambda s, pid=pid: _bystander_only(s, pid), 10)
        assert _bystander_only(st, pid), f"round {r}: the victim's leases/pins/writers outlived it: {st['index']}"
        assert waited <= RELEASE_S, f"round {r}: released only after {waited:.2f} s"
        release_s.append(waited)
        if phase == "retrieve":
            assert st["pool"]["free_bytes"] == free_before  # a reader's death frees exactly nothing
        else:  # every prefix the victim stored before dying is exact, torn ones are not served
            last = int(progress.read_text().strip() or 0)
            res = fault.spawn(d, "check-stream", "--last", str(last), "--window", "40").result()
            assert res["wrong"] == 0 and res["errors"] == {}, res
            assert res["prefixes_hit"] > 0, res
            checked += res["entries_checked"]

    stop.touch()
    by = bystander.result()
    assert by["wrong"] == 0 and by["errors"] == {}, by
    assert by["ops"] > 0
    st = d.status()
    idx = st["index"]
    assert (st["engines"], idx["leases"], idx["pinned_entries"], idx["writing"], idx["pending"]) == ([], 0, 0, 0, 0)
    after = fault.sweep(d, seed=2)
    assert after == before, f"pool figure after the kills {after} != before {before}: something leaked"
    assert caught >= 1, "no kill landed while the victim's copy was in flight"
    exact = (f"the victim's stored entries re-read byte-exact: {checked}" if phase == "store"
             else "pool free bytes unchanged by each kill")
    print(f"\nRELIABILITY engine-kill9-mid-{phase}: kills {ROUNDS} ({caught} with the copy in flight), "
          f"leases/pins/writers released within {max(release_s) * 1000:.0f} ms, bystander ops {by['ops']} "
          f"(errors 0, misses {by['misses']}, wrong bytes 0), {exact}, sweep figure (free bytes, entries, "
          f"bytes) before = after = {after}")
