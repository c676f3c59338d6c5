"""A lab-only stand-in for what Model Runner V2 does and the V1 runner does not: run the EC connector on a
step with no tokens to compute. Loaded into the PD's processes (never into the package) by
:func:`epd_lab.servers.pd_server` for ECMooncakeConnector (``EPD_LAB_V1_RUNNER_SHIM=1``, read by the lab's
``sitecustomize``, epd_lab/lab_site).

The bug it stands in for (vLLM 0.32 and 0.33, file:line in vLLM 0.32):

- ``distributed/ec_transfer/ec_connector/mooncake/scheduler.py:402-410``: the consumer starts the load
  of a pushed embedding (state LOADING) and reports the request not ready in the same step, so that step
  schedules no tokens;
- ``v1/worker/gpu_model_runner.py:3989-4004``: ``execute_model`` returns ``EMPTY_MODEL_RUNNER_OUTPUT``
  (or ``kv_connector_no_forward``) for a step with no tokens before it enters
  ``maybe_get_ec_connector_output``, so ``ECMooncakeWorker.start_load_caches`` never runs;
- ``mooncake/scheduler.py:504`` hands each load to the worker once, so on an idle server the transfer
  stays LOADING until ``push_wait_timeout_s`` (60 s) expires it and the request fails with HTTP 500.
  A server busy with other requests never has an empty step and is not affected.

Model Runner V2 does it right (``v1/worker/gpu/ec_connector.py:84-89``, ``no_forward``: EC send/recv even
with no work); the CPU build cannot use V2 (no Triton, ``config/vllm.py:725``). This shim does what
``no_forward`` does, in the V1 runner: when the stock ``execute_model`` has computed nothing on a step
that carries EC connector metadata for a consumer, it runs the connector's context and returns the
step's output with the connector's output attached.

It goes when vLLM's V1 runner runs the EC connector on empty steps (or the CPU build runs V2).

It also keeps the evidence the e2e tests read, because vLLM logs nothing per Mooncake transfer: one
INFO line per embedding ``ECMooncakeWorker.start_load_caches`` put into the encoder cache
(``epd-lab: Mooncake loaded <mm_hash> ...``), and one per empty step on which it ran the connector for
loads (``epd-lab: ran the EC connector on a step with no tokens``).
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any

from epd_lab.import_patch import patch_on_import

RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
MOONCAKE_WORKER_MODULE = "vllm.distributed.ec_transfer.ec_connector.mooncake.worker"
LOADED_LINE = "epd-lab: Mooncake loaded"
EMPTY_STEP_LINE = "epd-lab: ran the EC connector on a step with no tokens"

# A child of vLLM's logger, so the lines reach the server's log with vLLM's own format.
logger = logging.getLogger("vllm.epd_lab.v1_runner_shim")


def install() -> None:
    """Patch the two vLLM modules when they are imported (now, if they already are)."""
    patch_on_import({RUNNER_MODULE: _patch_runner, MOONCAKE_WORKER_MODULE: _patch_mooncake_worker})


def _patch_runner(module: ModuleType) -> None:
    from vllm.distributed.ec_transfer import get_ec_transfer, has_ec_transfer
    from vllm.v1.outputs import ModelRunnerOutput

    runner = module.GPUModelRunner
    stock = runner.execute_model

    def execute_model(self: Any, scheduler_output: Any, intermediate_tensors: Any = None) -> Any:
        output = stock(self, scheduler_output, intermediate_tensors)
        if (
            scheduler_output.total_num_scheduled_tokens
            or not isinstance(output, ModelRunnerOutput)
            or getattr(scheduler_output, "ec_connector_metadata", None) is None
            or not has_ec_transfer()
            or not get_ec_transfer().is_consumer
        ):
            return output
        with self.maybe_get_ec_connector_output(
            scheduler_output, encoder_cache=self.encoder_cache
        ) as ec_connector_output:
            pass
        # An idle engine steps without tokens in a loop while it waits; only steps that load say so.
        if getattr(scheduler_output.ec_connector_metadata, "loads", None):
            logger.info(EMPTY_STEP_LINE)
        return ModelRunnerOutput.with_ec_conn_output(output, ec_connector_output)

    execute_model.__wrapped__ = stock  # type: ignore[attr-defined]
    runner.execute_model = execute_model


def _patch_mooncake_worker(module: ModuleType) -> None:
    worker = module.ECMooncakeWorker
    stock = worker.start_load_caches

    def start_load_caches(self: Any, metadata: Any, encoder_cache: dict[str, Any], **kwargs: Any) -> None:
        before = set(encoder_cache)
        stock(self, metadata, encoder_cache, **kwargs)
        for spec in metadata.loads:
            if spec.mm_hash in encoder_cache and spec.mm_hash not in before:
                how = "from its own pool" if spec.local else f"by push (transfer {spec.transfer_id})"
                logger.info("%s %s: %d bytes %s", LOADED_LINE, spec.mm_hash, spec.nbytes, how)

    start_load_caches.__wrapped__ = stock  # type: ignore[attr-defined]
    worker.start_load_caches = start_load_caches
