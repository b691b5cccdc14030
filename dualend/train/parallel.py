"""Data parallelism for a training command started by torchrun: one process per CPU group or GPU,
each on its own batches, gradients averaged before every optimizer step (what DDP does), so the
replicas stay in step. Without torchrun's environment (WORLD_SIZE unset or 1) everything here is a
no-op and the command runs as one process.

    torchrun --nproc_per_node 2 -m builder.train convert ...            # two CPU processes (gloo)
    torchrun --nproc_per_node 8 -m builder.train convert --device cuda ...  # eight GPUs (nccl)
"""
from __future__ import annotations

import hashlib
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist


# How long the other replicas wait while the main one prepares a run alone (its teacher's answers to
# the chat prompts: 816 s for 1,568 on two CPU threads), beyond the collectives' own timeout (NCCL's
# default, 10 minutes, fails such a wait).
MAIN_PREPARES_TIMEOUT = timedelta(hours=4)


class Replicas:
    def __init__(self, device: str = "cpu", timeout: timedelta | None = None,
                 main_prepares_timeout: timedelta = MAIN_PREPARES_TIMEOUT):
        """`timeout`: the collectives' (None: the backend's default)."""
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if device == "cuda":
            if not torch.cuda.is_available():
                raise SystemExit("--device cuda: no CUDA device is visible to torch here")
            self.device = torch.device("cuda", local_rank)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        if self.world > 1:
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo", timeout=timeout)
            self._waits_for_main = dist.new_group(backend="gloo", timeout=main_prepares_timeout)

    @property
    def main(self) -> bool:
        """The replica that evaluates, logs and saves."""
        return self.rank == 0

    def average_gradients(self, parameters: list[torch.Tensor]) -> None:
        """Every replica's gradients replaced by their mean over the replicas (one all-reduce)."""
        if self.world == 1:
            return
        grads = [p.grad for p in parameters if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat /= self.world
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
            offset += grad.numel()

    def total(self, value: float) -> float:
        """`value` summed over the replicas."""
        if self.world == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor)
        return tensor.item()

    def any(self, flag: bool) -> bool:
        """Whether any replica says so: every replica stops at the same step."""
        return self.total(float(flag)) > 0

    def digests(self, state: dict[str, torch.Tensor]) -> list[str]:
        """Each replica's sha256 of `state` (tensors by name), gathered: equal while they are in step."""
        gathered = [None] * self.world
        dist.all_gather_object(gathered, state_digest(state))
        return gathered

    def wait_for_main(self) -> None:
        """A barrier for what the main replica prepares alone: up to `main_prepares_timeout`."""
        if self.world > 1:
            dist.barrier(group=self._waits_for_main)

    def exit_together(self) -> None:
        """Under torchrun, every replica's process ends here, together. A replica that tears down its
        group while another is still saving aborts in gloo's teardown, and even after a barrier and the
        group's destruction a replica's exit could abort there (SIGABRT, 'terminate called without an
        active exception', in C++ destructors of gloo's threads: a CI run of this session), so the process
        leaves without running them. Alone, nothing happens."""
        if self.world > 1:
            dist.barrier()
            dist.destroy_process_group()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)


def state_digest(state: dict[str, torch.Tensor]) -> str:
    """sha256 of tensors by name: the same for the same weights, whatever their device."""
    digest = hashlib.sha256()
    for name in sorted(state):
        digest.update(name.encode())
        digest.update(state[name].detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()
