"""The spool between vLLM engine replicas and their readers (blockdraft.engines.vllm.spool): requests
claimed in reading order, never more bytes than the budget (plus the item some reader needs first), a
replica's share of what waits left to the others,
files handed over whole and freed once read, a restarted reader's leftovers gone. Checked against a
brute-force rule that replays every claim."""

from __future__ import annotations

import random
import threading

import pytest

from blockdraft.engines.vllm.spool import CLAIMED, REQUESTS, Request, Spool, item_key, state_bytes


def test_keys_sort_in_the_order_ranks_read():
    keys = [item_key(s, p, k) for s in (0, 1, 12) for p in (0, 1) for k in (0, 3, 10)]
    assert sorted(keys) == keys  # step, then phase (held-out rows before the step's micro-batches), then slot
    assert Request.parse(Request(item_key(1, 1, 2), "ab-r0", 123).name) == Request(item_key(1, 1, 2), "ab-r0", 123)
    assert Request.parse("junk.json") is None
    assert state_bytes(10, 3, 8, 4) == 10 * (3 * 8 * 4 + 8) + 256


def allowed(held: list[Request], waiting: list[Request], budget: int, replicas: int = 1) -> list[Request]:
    """Brute force: walk the waiting requests in key order; take one while the held bytes fit the
    budget, or whatever its size when no held key is below it, and while what is taken stays within
    a `replicas`-th of the waiting bytes (the first always goes); stop at the first that may not go."""
    out, held = [], list(held)
    for r in sorted(waiting, key=lambda r: (r.key, r.client)):
        fits = sum(h.nbytes for h in held) + r.nbytes <= budget
        first = not held or all(r.key <= h.key for h in held)
        shared = not out or replicas * (sum(o.nbytes for o in out) + r.nbytes) <= sum(w.nbytes for w in waiting) + replicas - 1
        if not (fits or first) or not shared:
            break
        out.append(r)
        held.append(r)
    return out


@pytest.mark.parametrize("seed,replicas", [(s, 1 + s % 3) for s in range(9)])
def test_claims_follow_the_brute_force_rule(tmp_path, seed, replicas):
    rng = random.Random(seed)
    sp = Spool(tmp_path / f"s{seed}").make()
    budget = 1000
    for k in range(rng.randint(0, 3)):  # items claimed earlier and not read yet
        r = sp.ask(f"c{k % 2}", item_key(0, 1, rng.randint(0, 20)), [("d", [1])], rng.randint(50, 600))
        (sp.root / REQUESTS / r.name).rename(sp.root / CLAIMED / r.name)
    for k in range(rng.randint(1, 8)):
        sp.ask(f"c{k % 2}", item_key(0, rng.choice([0, 1]), rng.randint(0, 30)), [(f"d{k}", [1, 2, 3])],
               rng.randint(50, 900))
    held = [Request.parse(p.name) for p in (sp.root / CLAIMED).iterdir()]
    waiting = [Request.parse(p.name) for p in (sp.root / REQUESTS).iterdir()]
    want = allowed(held, waiting, budget, replicas)
    got = [req for req, _ in sp.claim(budget, max_documents=10**6, max_tokens=10**9, replicas=replicas)]
    assert got == want
    assert sp.stored_bytes() == sum(r.nbytes for r in held + want)


def test_a_batch_is_bounded_by_documents_and_tokens_but_takes_one_request_at_least(tmp_path):
    sp = Spool(tmp_path).make()
    for k in range(4):
        sp.ask("c", item_key(0, 1, k), [("a", list(range(50))), ("b", list(range(50)))], 10)
    got = sp.claim(10**9, max_documents=3, max_tokens=10**9)
    assert [r.key for r, _ in got] == [item_key(0, 1, 0)]  # a second item would make 4 documents
    got = sp.claim(10**9, max_documents=100, max_tokens=50)
    assert len(got) == 1 and len(got[0][1]) == 2  # alone it is taken, over the token bound


def test_an_item_is_read_whole_and_freed(tmp_path):
    sp = Spool(tmp_path).make()
    req = sp.ask("c", item_key(0, 1, 0), [("a", [1]), ("b", [2])], 100)
    (got, docs), = sp.claim(1000, 10, 100)
    assert not sp.done(req)
    files = {}
    for name, _ in docs:
        p = tmp_path / f"tmp-{name}"
        p.write_bytes(b"x" * 7)
        files[name] = str(p)
    sp.deliver(got, files)
    assert sp.done(req) and sorted(p.name for p in sp.item_dir(req).iterdir()) == ["a.safetensors", "b.safetensors"]
    assert sp.ready_bytes() == 14 + 0  # the marker is empty
    sp.release(req)
    assert not sp.done(req) and sp.stored_bytes() == 0 and sp.ready_bytes() == 0
    assert not any((tmp_path / CLAIMED).iterdir())


def test_a_restarted_reader_takes_back_what_it_asked_for(tmp_path):
    sp = Spool(tmp_path).make()
    a = sp.ask("run-r0", item_key(0, 1, 0), [("a", [1])], 10)
    sp.ask("run-r0", item_key(0, 1, 1), [("a", [1])], 10)
    sp.ask("run-r1", item_key(0, 1, 1), [("a", [1])], 10)
    (got, _), = sp.claim(10**9, 1, 10**9)
    assert got == a
    sp.forget_client("run-r0")
    (tmp_path / "f").write_bytes(b"z")
    sp.deliver(got, {"a": str(tmp_path / "f")})  # the engine finishes an item nobody wants any more
    assert not sp.done(a) and not (tmp_path / "f").exists()
    left = sorted(p.name for p in (tmp_path / REQUESTS).iterdir())
    assert left == [Request(item_key(0, 1, 1), "run-r1", 10).name]
    with pytest.raises(ValueError, match="letters, digits"):
        sp.ask("a~b", item_key(0, 1, 0), [], 1)


def test_two_replicas_claiming_at_once_never_take_an_item_twice_or_pass_the_budget(tmp_path):
    sp = Spool(tmp_path).make()
    for k in range(60):
        sp.ask(f"c{k % 3}", item_key(k // 6, 1, k % 6), [(f"d{k}", [k])], 100)
    budget, taken, peaks = 450, [], []
    lock = threading.Lock()

    def replica():
        for _ in range(200):
            got = sp.claim(budget, 2, 10**9)
            with lock:
                taken.extend(r for r, _ in got)
                peaks.append(sp.stored_bytes())
            for r, _ in got:  # read at once by its client
                sp.release(r)

    threads = [threading.Thread(target=replica) for _ in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert len(taken) == 60 == len(set(taken))
    assert max(peaks) <= budget + 100  # the budget, plus the one item a reader needs first
