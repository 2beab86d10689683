"""The process of tensor-parallel rank 1..N-1 (vLLM's WorkerProc): build this rank's Worker, then replay every
step rank 0 broadcasts until rank 0 ends the loop; exit at once if rank 0 dies."""
from __future__ import annotations

import logging
import os
import signal
import threading
import time

import torch

from engine.args import EngineArgs
from engine.logger import init_logger
from engine.worker.worker import Worker

logger = init_logger(__name__)

PARENT_POLL_S = 0.5


def run_worker(rank: int, world_size: int, init_method: str, args: EngineArgs, device_type: str,
               parent_pid: int, log_files: list[str], num_threads: int | None) -> None:
    """Entry of worker process `rank` (1..N-1): build this rank's Worker, then replay rank 0's steps until
    rank 0 sends the end of the loop (None). Exits at once if rank 0 dies (it cannot send anything then)."""
    # Ctrl-C and a launcher's SIGTERM reach the engine's whole process group: rank 0 shuts down and stops its
    # workers itself (between steps, with nothing lost), or they exit when it is gone.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _watch_parent(parent_pid)
    _setup_logging(rank, log_files)
    from engine.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel
    from engine.executor.multiproc import STEP_WAIT_TIMEOUT_S

    if num_threads:
        torch.set_num_threads(num_threads)
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    init_tensor_parallel(rank, world_size, init_method, device, object_timeout_s=STEP_WAIT_TIMEOUT_S)
    worker = _build_worker(args, device)
    logger.info("tensor-parallel rank %d ready on %s: %d KV blocks", rank, device, worker.num_gpu_blocks)
    _step_loop(worker)
    destroy_tensor_parallel()


def _build_worker(args: EngineArgs, device: torch.device) -> Worker:
    from engine.model.loader import load_model_config

    config = load_model_config(args.model, args.quantization, args.load_format)
    image_processor = None
    if config.is_multimodal:      # for the images' pixels and the profiled largest image
        from engine.inputs.image_processor import ImageProcessor
        kw = args.mm_processor_kwargs or {}
        image_processor = ImageProcessor.from_model_dir(args.model, min_pixels=kw.get("min_pixels"),
                                                        max_pixels=kw.get("max_pixels"))
    worker = Worker(args, config, device, image_processor)
    worker.initialize()
    return worker


def _step_loop(worker: Worker) -> None:
    from engine.distributed.parallel_state import broadcast_object

    while True:
        so = broadcast_object(None)
        if so is None:                       # rank 0 is shutting down
            return
        worker.execute_model(so)


def _watch_parent(parent_pid: int) -> None:
    """A worker whose engine process died exits: no one is left to send it steps or to stop it."""
    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(0)
            time.sleep(PARENT_POLL_S)
    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _setup_logging(rank: int, log_files: list[str]) -> None:
    """The engine's log format with the rank in front, to the inherited stderr and to rank 0's log files."""
    from engine.logger import _DATEFMT, _FORMAT, add_log_file

    for path in log_files:
        add_log_file(path)
    formatter = logging.Formatter(f"(rank {rank} pid {os.getpid()}) {_FORMAT}", _DATEFMT)
    for handler in logging.getLogger("engine").handlers:
        handler.setFormatter(formatter)
