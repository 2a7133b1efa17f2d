"""The sharded SPMD load, in its own process (SPMD is switched on before the first XLA tensor; the XLA lane's other
tests run without it):

    PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 python -m tests.runtime.model._sharded_load CHECKPOINT OUT.json --tp N

Loads the checkpoint N ways over the 4 virtual devices and writes the bytes the host sent to the devices, each
parameter's sharding spec, and each parameter's values read back whole (for the test to compare with the file).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--tp", type=int, required=True)
    args = parser.parse_args()
    from adapter_manager.spmd import mesh

    mesh(args.tp)
    import torch_xla
    import torch_xla.debug.metrics as metrics

    from adapter_manager.runtime.model.checkpoint import load_model

    model = load_model(args.checkpoint, dtype=torch.float32, device=torch_xla.device(), tensor_parallel=args.tp)
    sent = metrics.metric_data("OutboundData")
    params = {}
    for name, param in model.named_parameters():
        spec = torch_xla._XLAC._get_xla_sharding_spec(param)
        nbytes = param.numel() * param.element_size()
        params[name] = {"spec": spec, "sum": float(param.detach().cpu().double().sum()), "nbytes": nbytes}
    args.out.write_text(json.dumps({"sent_bytes": 0 if sent is None else sent[1], "params": params}))


if __name__ == "__main__":
    main()
