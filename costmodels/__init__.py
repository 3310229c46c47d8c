"""costmodels: hardware and kernel cost models for fusesearch, with no knowledge of graphs.

Problem: a fusion search needs to know what a candidate kernel costs on a given GPU.
Approach: `DeviceSpec` (sourced datasheet figures, or this machine via `host_cpu()`) and
`KernelSpec` (counts a lowering produces) go into `RooflineModel.cost`, which returns a
`KernelCost`; `Profile` files carry a device with fitted `RooflineParams`.
Invariant: this package never imports `fusesearch` (the dependency points one way only).
"""

from costmodels.devices import (
    DEVICES,
    DeviceSpec,
    device_table_rows,
    get_device,
    host_cpu,
)
from costmodels.errors import CostModelError, InvalidSpec, ProfileError, UnknownDevice
from costmodels.kernel import DTYPE_BYTES, IMPLS, TEMPLATES, KernelSpec
from costmodels.probes import measure_copy_bandwidth
from costmodels.profile import SCHEMA, Profile, load_device, load_profile, save_profile
from costmodels.resources import (
    Occupancy,
    RegisterEstimate,
    achieved_occupancy,
    estimate_registers,
    grid_blocks,
    occupancy,
)
from costmodels.roofline import (
    KernelCost,
    RooflineModel,
    RooflineParams,
    compute_unit,
    host_params,
    scalar_peak_flops_per_s,
    tensor_peak_flops_per_s,
)

__all__ = [
    "DEVICES",
    "compute_unit",
    "DTYPE_BYTES",
    "IMPLS",
    "SCHEMA",
    "TEMPLATES",
    "CostModelError",
    "DeviceSpec",
    "InvalidSpec",
    "KernelCost",
    "KernelSpec",
    "Occupancy",
    "Profile",
    "ProfileError",
    "RegisterEstimate",
    "RooflineModel",
    "RooflineParams",
    "UnknownDevice",
    "achieved_occupancy",
    "device_table_rows",
    "estimate_registers",
    "get_device",
    "host_params",
    "grid_blocks",
    "host_cpu",
    "load_device",
    "load_profile",
    "measure_copy_bandwidth",
    "occupancy",
    "save_profile",
    "scalar_peak_flops_per_s",
    "tensor_peak_flops_per_s",
]
