"""Weights handed over in place between processes of one node: the bucket layout and the handle transport.

The trainer packs a version into a few large buffers (buckets: tensors back to back in stream order, each at an
offset aligned to ALIGN_BYTES) and shares each buffer without copying it anywhere: a CUDA buffer through the
CUDA IPC handle of its allocation (HIP IPC on ROCm, the same torch calls), a buffer on CPU through a POSIX
shared-memory object. What identifies a shared buffer are the fields torch's own multiprocessing reductions
send (torch/multiprocessing/reductions.py, reduce_tensor / reduce_storage with the file_system strategy):

- cuda: UntypedStorage._share_cuda_() -> (device, handle, storage_size_bytes, storage_offset_bytes,
  ref_counter_handle, ref_counter_offset, event_handle, event_sync_required), rebuilt by
  UntypedStorage._new_shared_cuda(...) with the same eight, as rebuild_cuda_tensor does;
- cpu_shm: UntypedStorage._share_filename_cpu_() -> (manager socket, object name, size), rebuilt by
  UntypedStorage._new_shared_filename_cpu(...), as rebuild_storage_filename does.

torch sends those tuples through pickle; here they travel as typed proto fields (pb.IpcBucket) and the
receiver calls the rebuild functions itself, after checking every field (check_handles): nothing from the
wire is ever unpickled. The device index a handle names is never taken from the wire: the receiver maps on
its own index of the device whose UUID the trainer reported, and refuses a UUID it does not see.

ROCm: torch is hipified, so _share_cuda_ calls hipIpcGetMemHandle and _new_shared_cuda hipIpcOpenMemHandle;
the fields are the same. One difference: HIP has no IPC events, so a ROCm producer synchronizes its stream
when it shares and sends event_sync_required False (its event_handle bytes are then meaningless and not
opened); the receiver's code is the same. torch's CUDA IPC needs the caching allocator's ordinary segments:
with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True the handle is an expandable segment's, which the
receiver can only open through pidfd_getfd (same PID namespace, ptrace rights); the trainer refuses that.
"""
from __future__ import annotations

import math
import os
import re
import socket
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from proto import lockstep_pb2 as pb
from services.common.tensors import dtype_from_name, dtype_name

BACKENDS = ("cuda", "cpu_shm")
# Every tensor starts at a multiple of this in its bucket: any dtype's view is aligned, copies are coalesced.
ALIGN_BYTES = 256
DEFAULT_BUCKET_BYTES = 1024 * 1024 * 1024
# Bounds on what a receiver accepts as handle bytes (torch's are 64 to a few hundred bytes).
MAX_HANDLE_BYTES = 4096
# Shared-memory names torch makes (libshm / RefcountedMapAllocator: "/torch_<pid>_<random>_<counter>").
SHM_NAME = re.compile(rb"^/torch_[0-9]{1,10}_[0-9]{1,20}_[0-9]{1,20}$")
# torch_shm_manager's socket: <tmp>/torch-shm-dir-XXXXXX/manager.sock, absolute, no '..'.
SHM_MANAGER = re.compile(rb"^(/[A-Za-z0-9._-]+)*/torch-shm-dir-[A-Za-z0-9]{1,32}/manager\.sock$")


class HandleRefused(ValueError):
    """A handover that is not this replica's to map: another node, another device, a stale version, a
    handover id other than the one asked for, or fields that are not a torch share. Nothing was mapped."""


@dataclass(frozen=True)
class TensorSlot:
    name: str
    dtype: str  # wire dtype name (services.common.tensors)
    shape: tuple[int, ...]
    offset: int  # bytes into the bucket
    nbytes: int


@dataclass(frozen=True)
class BucketLayout:
    slots: tuple[TensorSlot, ...]
    nbytes: int


def align(n: int) -> int:
    return -(-n // ALIGN_BYTES) * ALIGN_BYTES


def plan_layout(tensors: Sequence[tuple[str, str, tuple[int, ...], int]], bucket_bytes: int) -> list[BucketLayout]:
    """Pure. (name, dtype, shape, nbytes) in order -> buckets of at most `bucket_bytes` (a larger tensor alone),
    each tensor at an ALIGN_BYTES-aligned offset. Dtypes may mix within a bucket: each slot names its own."""
    if bucket_bytes < ALIGN_BYTES:
        raise ValueError(f"bucket_bytes: must be >= {ALIGN_BYTES}, got {bucket_bytes}")
    buckets: list[list[TensorSlot]] = []
    end = 0
    for name, dtype, shape, nbytes in tensors:
        offset = align(end)
        if not buckets or (offset + nbytes > bucket_bytes and buckets[-1]):
            buckets.append([])
            offset = 0
        buckets[-1].append(TensorSlot(name, dtype, tuple(shape), offset, nbytes))
        end = offset + nbytes
    return [BucketLayout(tuple(b), max(b[-1].offset + b[-1].nbytes, 1)) for b in buckets]


def layout_of(named: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int,
              cast_to: torch.dtype | None = None) -> list[BucketLayout]:
    """The buckets of `named` as they are, or cast to `cast_to` (its floating tensors) as pack will cast them."""
    def dtype(t: torch.Tensor) -> torch.dtype:
        return cast_to if cast_to is not None and t.is_floating_point() else t.dtype

    return plan_layout([(n, dtype_name(dtype(t)), tuple(t.shape), t.numel() * dtype(t).itemsize)
                        for n, t in named], bucket_bytes)


def layout_proto(layout: BucketLayout) -> pb.IpcBucket:
    return pb.IpcBucket(nbytes=layout.nbytes, tensors=[
        pb.IpcTensor(name=s.name, dtype=s.dtype, shape=list(s.shape), offset=s.offset) for s in layout.slots])


def checked_layout(bucket: pb.IpcBucket, where: str, names: set[str]) -> BucketLayout:
    """A bucket's layout once every slot lies inside it, in order, without overlap (ValueError naming the field).
    `names` collects the names seen so far (one name once over all buckets)."""
    slots, end = [], 0
    if not bucket.tensors:
        raise HandleRefused(f"{where}.tensors: empty")
    for t, tensor in enumerate(bucket.tensors):
        field = f"{where}.tensors[{t}]"
        dtype = dtype_from_name(tensor.dtype, field=f"{field}.dtype")
        shape = tuple(int(d) for d in tensor.shape)
        if not tensor.name or tensor.name in names:
            raise HandleRefused(f"{field}.name: empty or repeated ({tensor.name!r})")
        if any(d < 0 for d in shape):
            raise HandleRefused(f"{field}.shape: negative dimension in {list(shape)}")
        nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        if tensor.offset < end or tensor.offset % ALIGN_BYTES or tensor.offset + nbytes > bucket.nbytes:
            raise HandleRefused(f"{field}.offset: {tensor.offset} (+{nbytes} bytes) is not an aligned slot after "
                                f"byte {end} inside the bucket's {bucket.nbytes}")
        names.add(tensor.name)
        slots.append(TensorSlot(tensor.name, tensor.dtype, shape, int(tensor.offset), nbytes))
        end = tensor.offset + nbytes
    return BucketLayout(tuple(slots), int(bucket.nbytes))


def bucket_views(buffer: torch.Tensor, layout: BucketLayout) -> list[tuple[str, torch.Tensor]]:
    """The bucket's tensors as views of `buffer` (uint8, flat; no copy)."""
    return [(s.name, buffer[s.offset:s.offset + s.nbytes].view(dtype_from_name(s.dtype)).reshape(s.shape))
            for s in layout.slots]


def pack(buffer: torch.Tensor, layout: BucketLayout, tensors: Sequence[torch.Tensor]) -> None:
    """Copy `tensors` (the layout's, in order) into their slots of `buffer` (asynchronously on a device), cast
    to each slot's dtype as they are copied (round to nearest even, as `tensor.to(dtype)`)."""
    for (_, view), tensor in zip(bucket_views(buffer, layout), tensors):
        view.copy_(tensor.detach(), non_blocking=True)


# ----------------------------------------------------------------- identity --

def node_id() -> str:
    """What two processes share when they can map each other's buffers: the kernel's boot (the same machine
    since it started) and the IPC namespace (containers see each other's shared memory only in one)."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    return f"{boot}/{os.readlink('/proc/self/ns/ipc')}"


def hostname() -> str:
    return socket.gethostname()


def device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def visible_device_uuids() -> list[str]:
    """UUIDs of the GPUs this process sees (CUDA_VISIBLE_DEVICES applied), in index order; [] without any."""
    if not torch.cuda.is_available():
        return []
    return [device_uuid(i) for i in range(torch.cuda.device_count())]


def local_index(uuid: str) -> int:
    """This process's index of the device `uuid`; HandleRefused when it does not see it."""
    uuids = visible_device_uuids()
    if not uuid or uuid not in uuids:
        raise HandleRefused(f"device_uuid: the handles are for device {uuid!r}, which this process does not see "
                            f"(it sees {uuids})")
    return uuids.index(uuid)


def node_details(device: str | torch.device | None) -> dict[str, str]:
    """What a service reports (ServiceInfo.details) so the coordinator can tell whether an IPC handover can
    reach it: its node, host name, the GPUs it sees and the one its weights are on ("" on CPU)."""
    uuids = visible_device_uuids()
    weights_uuid = ""
    if device is not None and torch.device(device).type == "cuda" and uuids:
        index = torch.device(device).index
        weights_uuid = uuids[index if index is not None else torch.cuda.current_device()]
    return {"node_id": node_id(), "hostname": hostname(), "device_uuids": ",".join(uuids),
            "weights_device_uuid": weights_uuid}


def backend_for(device: torch.device) -> str:
    return "cuda" if device.type == "cuda" else "cpu_shm"


# ------------------------------------------------------------------ export --

def allocate(nbytes: int, device: torch.device) -> torch.Tensor:
    """A bucket's buffer, shareable: device memory from the caching allocator, or a shared-memory object."""
    if device.type == "cuda":
        if "expandable_segments:true" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").replace(" ", "").lower():
            raise RuntimeError("weight_sync ipc: PYTORCH_CUDA_ALLOC_CONF sets expandable_segments, whose handles a "
                               "replica can open only through pidfd_getfd; unset it on the trainer")
        # Zeroed, not empty: the alignment gaps between tensors then hold finite bytes, so a receiver checks a
        # run of tensors with one reduction (finite_check.bucket_non_finite). A memset costs well under a ms/GB.
        return torch.zeros(nbytes, dtype=torch.uint8, device=device)
    storage = torch.UntypedStorage._new_using_filename_cpu(nbytes)
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,))


def export(buffer: torch.Tensor, into: pb.IpcBucket) -> None:
    """Fill `into`'s handle fields for `buffer`. For CUDA each call is one share with reference counters of its
    own (torch counts a share until its receiver drops the mapping), so each replica gets its own."""
    storage = buffer.untyped_storage()
    if buffer.is_cuda:
        (_, handle, size_bytes, offset_bytes, ref_counter, ref_offset, event_handle,
         event_sync) = storage._share_cuda_()
        into.handle, into.storage_size_bytes, into.storage_offset_bytes = handle, size_bytes, offset_bytes
        into.ref_counter_handle, into.ref_counter_offset = ref_counter, ref_offset
        into.event_handle, into.event_sync_required = event_handle or b"", bool(event_sync)
    else:
        manager, name, _ = storage._share_filename_cpu_()
        into.shm_manager, into.shm_name = manager, name


def drop_share(bucket: pb.IpcBucket) -> None:
    """The trainer's side of a share no receiver will release (it refused or failed before mapping, or went
    away): drop its CUDA reference counter so the buffer can be freed. Nothing to do for shared memory."""
    if bucket.ref_counter_handle:
        torch.UntypedStorage._release_ipc_counter_cuda(bucket.ref_counter_handle, bucket.ref_counter_offset)


# ------------------------------------------------------------------- map --

def check_handles(handles: pb.WeightHandles, *, run_id: str, policy_version: int, handover_id: str,
                  current_version: int, node: str) -> list[BucketLayout]:
    """The handover's bucket layouts once it is the one this replica asked for and may map: the run, version
    and handover id it asked for, a version newer than the one it holds, this node, a known backend, handle
    fields of torch's shape. HandleRefused (naming the field) otherwise; nothing is mapped."""
    if handles.run_id != run_id:
        raise HandleRefused(f"run_id: handles of run {handles.run_id!r}, asked for {run_id!r}")
    if handles.handover_id != handover_id:
        raise HandleRefused(f"handover_id: handles of handover {handles.handover_id!r}, not the one asked for")
    if handles.policy_version != policy_version:
        raise HandleRefused(f"policy_version: handles of version {handles.policy_version}, asked for {policy_version}")
    if policy_version <= current_version:
        raise HandleRefused(f"policy_version: {policy_version} is stale; this replica holds {current_version}")
    if handles.node_id != node:
        raise HandleRefused(f"node_id: the handles come from node {handles.node_id!r}, this replica runs on {node!r}")
    if handles.backend not in BACKENDS:
        raise HandleRefused(f"backend: {handles.backend!r} is not one of {list(BACKENDS)}")
    if not handles.share_id:
        raise HandleRefused("share_id: empty")
    names: set[str] = set()
    layouts = []
    for b, bucket in enumerate(handles.buckets):
        where = f"buckets[{b}]"
        layouts.append(checked_layout(bucket, where, names))
        _check_fields(handles.backend, bucket, where)
    if not layouts:
        raise HandleRefused("buckets: empty")
    if handles.tensors != len(names) or handles.bytes != sum(s.nbytes for lay in layouts for s in lay.slots):
        raise HandleRefused(f"tensors/bytes: {handles.tensors}/{handles.bytes} do not match the buckets")
    return layouts


def _check_fields(backend: str, bucket: pb.IpcBucket, where: str) -> None:
    if backend == "cuda":
        if not 0 < len(bucket.handle) <= MAX_HANDLE_BYTES or len(bucket.event_handle) > MAX_HANDLE_BYTES:
            raise HandleRefused(f"{where}.handle: {len(bucket.handle)} bytes, not a CUDA IPC handle")
        if bucket.storage_size_bytes < bucket.nbytes or bucket.storage_offset_bytes < 0:
            raise HandleRefused(f"{where}.storage_size_bytes: {bucket.storage_size_bytes} at offset "
                                f"{bucket.storage_offset_bytes} cannot hold the bucket's {bucket.nbytes} bytes")
        if not SHM_NAME.match(bucket.ref_counter_handle) or bucket.ref_counter_offset < 0:
            raise HandleRefused(f"{where}.ref_counter_handle: not a torch reference counter")
        if bucket.event_sync_required and not bucket.event_handle:
            raise HandleRefused(f"{where}.event_handle: empty, but event_sync_required")
        if bucket.shm_manager or bucket.shm_name:
            raise HandleRefused(f"{where}.shm_name: set on a cuda handover")
    else:
        if not SHM_NAME.match(bucket.shm_name):
            raise HandleRefused(f"{where}.shm_name: not a torch shared-memory name")
        if not SHM_MANAGER.match(bucket.shm_manager) or b"/../" in bucket.shm_manager:
            raise HandleRefused(f"{where}.shm_manager: not torch_shm_manager's socket")
        if bucket.handle or bucket.ref_counter_handle:
            raise HandleRefused(f"{where}.handle: set on a cpu_shm handover")


def open_bucket(backend: str, bucket: pb.IpcBucket, index: int) -> torch.Tensor:
    """Map one checked bucket (check_handles) as a flat uint8 tensor; `index`: this process's index of the
    handover's device (local_index), never the trainer's. Dropping every reference to the tensor unmaps it and,
    for CUDA, releases torch's reference counter (the trainer may then free the buffer)."""
    if backend == "cuda":
        storage = torch.UntypedStorage._new_shared_cuda(
            index, bucket.handle, bucket.storage_size_bytes, bucket.storage_offset_bytes, bucket.ref_counter_handle,
            bucket.ref_counter_offset, bucket.event_handle, bucket.event_sync_required)
        device = torch.device("cuda", index)
    else:
        # Mapping past the object's end would fault on first touch: its size is checked first.
        size = os.stat(b"/dev/shm" + bucket.shm_name).st_size
        if size < bucket.nbytes:
            raise HandleRefused(f"bucket of {bucket.nbytes} bytes: its shared-memory object holds {size}")
        storage = torch.UntypedStorage._new_shared_filename_cpu(bucket.shm_manager, bucket.shm_name, bucket.nbytes)
        device = torch.device("cpu")
    if storage.nbytes() < bucket.nbytes:
        raise HandleRefused(f"bucket of {bucket.nbytes} bytes maps to only {storage.nbytes()}")
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (bucket.nbytes,))
