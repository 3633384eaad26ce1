"""A stand-in trainer, run as its own process: joins a weights group as rank 0 and broadcasts a checkpoint's
tensors in sorted name order (`python -m tests.common.rpc.weight_trainer CHECKPOINT_DIR PORT WORLD_SIZE GROUP`)."""

from __future__ import annotations

import sys

from safetensors.torch import load_file

from tandem.common.control.weight_sync import join_group


def main(checkpoint: str, port: int, world_size: int, group_name: str) -> int:
    tensors = load_file(f"{checkpoint}/model.safetensors")
    group = join_group("127.0.0.1", port, 0, world_size, group_name, timeout_s=60)
    print("joined", flush=True)
    for name in sorted(tensors):
        group.broadcast(tensors[name].contiguous(), src=0)
    print(f"broadcast {len(tensors)} tensors", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]))
