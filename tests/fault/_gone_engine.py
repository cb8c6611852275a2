"""An engine process for tests/fault/test_engine_gone.py: registers host KV memory, sends one store, then waits
to be killed.

``python _gone_engine.py SOCKET MODE [--fork]``

- ``MODE=event``: a small store carrying a step-end event handle (the GPU path's ``wait_event``), which the
  test's copy engine holds until the daemon abandons it.
- ``MODE=big``: a store of ``BIG_CHUNKS`` chunks of 2 MiB (the host copy engine copies them in one job),
  sent once a line arrives on stdin, so the test is watching the daemon when it starts.
- ``--fork``: before announcing itself, fork a child that keeps every descriptor (the connection
  included) and sleeps: the daemon must notice this process's exit although the socket stays open.

Prints one JSON line ``{"ready": true, "child": PID}`` (``child`` 0 without ``--fork``), then sleeps.
"""

from __future__ import annotations

import json
import os
import sys
import time

from hkvd.shim.testing.synthetic import GroupShape, SyntheticEngine, prompt_tokens
from hkvd.transport.keys import chunk_keys
from hkvd.transport.wire.kv import EVENT_HANDLE_BYTES

MIB = 1 << 20
BIG_CHUNKS = 192  # 384 MiB: 192 entries of 2 layers x 1 MiB


def main() -> None:
    socket_path, mode = sys.argv[1], sys.argv[2]
    chunks = BIG_CHUNKS if mode == "big" else 2
    eng = SyntheticEngine(socket_path, [GroupShape("full", 2, MIB)], num_blocks=1 + chunks, tokens_per_block=16,
                          chunk_size=16, model=f"gone-{mode}", timeout_s=60.0)
    eng.buffer[:] = 7  # touch every page: the copy reads resident memory, as an engine's KV cache is
    items = eng.items(0, chunk_keys(prompt_tokens(16 * chunks, seed=os.getpid()), 16), first_block=1)
    child = 0
    if mode == "event":
        eng.client.submit_store(items, wait_event=b"\x01" * EVENT_HANDLE_BYTES)
    if "--fork" in sys.argv:
        child = os.fork()
        if child == 0:  # keeps the connection open after its parent is killed
            time.sleep(120)
            os._exit(0)
    sys.stdout.write(json.dumps({"ready": True, "child": child}) + "\n")
    sys.stdout.flush()
    if mode == "big":
        sys.stdin.readline()
        eng.client.submit_store(items)
    time.sleep(120)


if __name__ == "__main__":
    main()
