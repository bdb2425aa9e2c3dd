"""vLLM's own KV-event publisher (`vllm.distributed.kv_events.ZmqEventPublisher`), kept busy: run with the vLLM
venv's Python (bench/vllm_engine.py finds it), it publishes one batch every `--interval-s` until its stdin closes.

Batch i stores block `FIRST_HASH + i` (token ids `i * block_size ...`, parent: the block before) and removes the
block `window` places back, so after batch i the engine holds exactly blocks i-window+1 .. i. Prints one JSON
line with its endpoints when it is publishing. Imports nothing of kvgate: it runs where only vLLM is installed.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time

FIRST_HASH = 1000


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--replay-port", type=int, required=True)
    parser.add_argument("--interval-s", type=float, default=0.02)
    parser.add_argument("--block-size", type=int, default=4)
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--topic", default="kv-events")
    args = parser.parse_args()

    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch, ZmqEventPublisher

    publisher = ZmqEventPublisher(0, endpoint=f"tcp://*:{args.port}", replay_endpoint=f"tcp://*:{args.replay_port}",
                                  topic=args.topic)
    stop = threading.Event()

    def stop_at_eof() -> None:
        sys.stdin.read()
        stop.set()

    threading.Thread(target=stop_at_eof, daemon=True).start()
    bs = args.block_size
    print(json.dumps({"events": f"tcp://127.0.0.1:{args.port}", "replay": f"tcp://127.0.0.1:{args.replay_port}",
                      "first_hash": FIRST_HASH, "window": args.window}), flush=True)
    i = 0
    try:
        while not stop.is_set():
            events: list[object] = [BlockStored(
                block_hashes=[FIRST_HASH + i], parent_block_hash=FIRST_HASH + i - 1 if i else None,
                token_ids=list(range(i * bs, (i + 1) * bs)), block_size=bs, lora_id=None, medium="GPU",
                lora_name=None)]
            if i >= args.window:
                events.append(BlockRemoved(block_hashes=[FIRST_HASH + i - args.window], medium="GPU"))
            publisher.publish(KVEventBatch(ts=time.time(), events=events))
            i += 1
            time.sleep(args.interval_s)
    finally:
        publisher.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
