from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ServiceInfo(_message.Message):
    __slots__ = ("service", "version", "run_id", "model_path", "policy_version", "details")
    class DetailsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SERVICE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    service: str
    version: str
    run_id: str
    model_path: str
    policy_version: int
    details: _containers.ScalarMap[str, str]
    def __init__(self, service: _Optional[str] = ..., version: _Optional[str] = ..., run_id: _Optional[str] = ..., model_path: _Optional[str] = ..., policy_version: _Optional[int] = ..., details: _Optional[_Mapping[str, str]] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("ok", "status")
    OK_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    status: str
    def __init__(self, ok: _Optional[bool] = ..., status: _Optional[str] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids", "greedy")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    GREEDY_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    greedy: bool
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., greedy: _Optional[bool] = ...) -> None: ...

class Prompt(_message.Message):
    __slots__ = ("group_id", "token_ids", "seed", "problem")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PROBLEM_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    token_ids: Tensor
    seed: int
    problem: EpisodeProblem
    def __init__(self, group_id: _Optional[str] = ..., token_ids: _Optional[_Union[Tensor, _Mapping]] = ..., seed: _Optional[int] = ..., problem: _Optional[_Union[EpisodeProblem, _Mapping]] = ...) -> None: ...

class EpisodeSettings(_message.Message):
    __slots__ = ("environment", "options_json", "limits_json")
    ENVIRONMENT_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_JSON_FIELD_NUMBER: _ClassVar[int]
    LIMITS_JSON_FIELD_NUMBER: _ClassVar[int]
    environment: str
    options_json: str
    limits_json: str
    def __init__(self, environment: _Optional[str] = ..., options_json: _Optional[str] = ..., limits_json: _Optional[str] = ...) -> None: ...

class EpisodeProblem(_message.Message):
    __slots__ = ("problem_id", "prompt", "answer")
    PROBLEM_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    problem_id: str
    prompt: str
    answer: str
    def __init__(self, problem_id: _Optional[str] = ..., prompt: _Optional[str] = ..., answer: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("run_id", "step", "policy_version", "prompts", "sampling", "samples_per_prompt", "resumed", "episode", "sample_ids")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_PROMPT_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FIELD_NUMBER: _ClassVar[int]
    EPISODE_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_IDS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    step: int
    policy_version: int
    prompts: _containers.RepeatedCompositeFieldContainer[Prompt]
    sampling: SamplingParams
    samples_per_prompt: int
    resumed: _containers.RepeatedCompositeFieldContainer[ResumedSample]
    episode: EpisodeSettings
    sample_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, run_id: _Optional[str] = ..., step: _Optional[int] = ..., policy_version: _Optional[int] = ..., prompts: _Optional[_Iterable[_Union[Prompt, _Mapping]]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., samples_per_prompt: _Optional[int] = ..., resumed: _Optional[_Iterable[_Union[ResumedSample, _Mapping]]] = ..., episode: _Optional[_Union[EpisodeSettings, _Mapping]] = ..., sample_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ResumedSample(_message.Message):
    __slots__ = ("sample_id", "response_token_ids", "logprobs", "policy_versions")
    SAMPLE_ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    sample_id: str
    response_token_ids: Tensor
    logprobs: Tensor
    policy_versions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, sample_id: _Optional[str] = ..., response_token_ids: _Optional[_Union[Tensor, _Mapping]] = ..., logprobs: _Optional[_Union[Tensor, _Mapping]] = ..., policy_versions: _Optional[_Iterable[int]] = ...) -> None: ...

class Sample(_message.Message):
    __slots__ = ("group_id", "sample_id", "index", "response_token_ids", "logprobs", "finish_reason", "policy_versions", "prompt_token_ids", "response_mask", "episode_reward", "turns", "end_reason", "tool_calls", "tool_errors", "turn_rewards", "routed_experts")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_MASK_FIELD_NUMBER: _ClassVar[int]
    EPISODE_REWARD_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    END_REASON_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_ERRORS_FIELD_NUMBER: _ClassVar[int]
    TURN_REWARDS_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    sample_id: str
    index: int
    response_token_ids: Tensor
    logprobs: Tensor
    finish_reason: str
    policy_versions: _containers.RepeatedScalarFieldContainer[int]
    prompt_token_ids: Tensor
    response_mask: Tensor
    episode_reward: float
    turns: int
    end_reason: str
    tool_calls: int
    tool_errors: int
    turn_rewards: _containers.RepeatedScalarFieldContainer[float]
    routed_experts: Tensor
    def __init__(self, group_id: _Optional[str] = ..., sample_id: _Optional[str] = ..., index: _Optional[int] = ..., response_token_ids: _Optional[_Union[Tensor, _Mapping]] = ..., logprobs: _Optional[_Union[Tensor, _Mapping]] = ..., finish_reason: _Optional[str] = ..., policy_versions: _Optional[_Iterable[int]] = ..., prompt_token_ids: _Optional[_Union[Tensor, _Mapping]] = ..., response_mask: _Optional[_Union[Tensor, _Mapping]] = ..., episode_reward: _Optional[float] = ..., turns: _Optional[int] = ..., end_reason: _Optional[str] = ..., tool_calls: _Optional[int] = ..., tool_errors: _Optional[int] = ..., turn_rewards: _Optional[_Iterable[float]] = ..., routed_experts: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("samples", "policy_version", "engine")
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    samples: _containers.RepeatedCompositeFieldContainer[Sample]
    policy_version: int
    engine: str
    def __init__(self, samples: _Optional[_Iterable[_Union[Sample, _Mapping]]] = ..., policy_version: _Optional[int] = ..., engine: _Optional[str] = ...) -> None: ...

class PauseGenerationRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class PauseGenerationResponse(_message.Message):
    __slots__ = ("paused",)
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    paused: bool
    def __init__(self, paused: _Optional[bool] = ...) -> None: ...

class LoadModelRequest(_message.Message):
    __slots__ = ("run_id", "model_path", "policy_version", "engine_config_json")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    ENGINE_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    model_path: str
    policy_version: int
    engine_config_json: str
    def __init__(self, run_id: _Optional[str] = ..., model_path: _Optional[str] = ..., policy_version: _Optional[int] = ..., engine_config_json: _Optional[str] = ...) -> None: ...

class LoadModelResponse(_message.Message):
    __slots__ = ("info",)
    INFO_FIELD_NUMBER: _ClassVar[int]
    info: ServiceInfo
    def __init__(self, info: _Optional[_Union[ServiceInfo, _Mapping]] = ...) -> None: ...

class WeightChunk(_message.Message):
    __slots__ = ("run_id", "policy_version", "name", "dtype", "shape", "offset", "tensor_nbytes", "data", "chunk_sha256", "last", "total_sha256", "total_chunks", "lora")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TENSOR_NBYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SHA256_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SHA256_FIELD_NUMBER: _ClassVar[int]
    TOTAL_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    policy_version: int
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    tensor_nbytes: int
    data: bytes
    chunk_sha256: str
    last: bool
    total_sha256: str
    total_chunks: int
    lora: LoraAdapter
    def __init__(self, run_id: _Optional[str] = ..., policy_version: _Optional[int] = ..., name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., tensor_nbytes: _Optional[int] = ..., data: _Optional[bytes] = ..., chunk_sha256: _Optional[str] = ..., last: _Optional[bool] = ..., total_sha256: _Optional[str] = ..., total_chunks: _Optional[int] = ..., lora: _Optional[_Union[LoraAdapter, _Mapping]] = ...) -> None: ...

class LoraAdapter(_message.Message):
    __slots__ = ("rank", "alpha", "target_modules")
    RANK_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    rank: int
    alpha: float
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, rank: _Optional[int] = ..., alpha: _Optional[float] = ..., target_modules: _Optional[_Iterable[str]] = ...) -> None: ...

class UpdateWeightsResponse(_message.Message):
    __slots__ = ("policy_version", "tensors", "bytes", "total_sha256", "engine_checksum", "prefetched")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SHA256_FIELD_NUMBER: _ClassVar[int]
    ENGINE_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    PREFETCHED_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    tensors: int
    bytes: int
    total_sha256: str
    engine_checksum: str
    prefetched: bool
    def __init__(self, policy_version: _Optional[int] = ..., tensors: _Optional[int] = ..., bytes: _Optional[int] = ..., total_sha256: _Optional[str] = ..., engine_checksum: _Optional[str] = ..., prefetched: _Optional[bool] = ...) -> None: ...

class SyncWeightsRequest(_message.Message):
    __slots__ = ("run_id", "policy_version", "trainer_address")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    TRAINER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    policy_version: int
    trainer_address: str
    def __init__(self, run_id: _Optional[str] = ..., policy_version: _Optional[int] = ..., trainer_address: _Optional[str] = ...) -> None: ...

class LoadWeightsRequest(_message.Message):
    __slots__ = ("run_id", "policy_version", "directory", "expected_sha256", "prefetch")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_SHA256_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    policy_version: int
    directory: str
    expected_sha256: str
    prefetch: bool
    def __init__(self, run_id: _Optional[str] = ..., policy_version: _Optional[int] = ..., directory: _Optional[str] = ..., expected_sha256: _Optional[str] = ..., prefetch: _Optional[bool] = ...) -> None: ...

class BroadcastTensor(_message.Message):
    __slots__ = ("name", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class BroadcastBucket(_message.Message):
    __slots__ = ("tensors", "nbytes")
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[BroadcastTensor]
    nbytes: int
    def __init__(self, tensors: _Optional[_Iterable[_Union[BroadcastTensor, _Mapping]]] = ..., nbytes: _Optional[int] = ...) -> None: ...

class BroadcastPlan(_message.Message):
    __slots__ = ("run_id", "policy_version", "group_name", "rendezvous", "backend", "world_size", "buckets", "tensors", "bytes", "lora", "digest_trailer")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    GROUP_NAME_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    DIGEST_TRAILER_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    policy_version: int
    group_name: str
    rendezvous: str
    backend: str
    world_size: int
    buckets: _containers.RepeatedCompositeFieldContainer[BroadcastBucket]
    tensors: int
    bytes: int
    lora: LoraAdapter
    digest_trailer: bool
    def __init__(self, run_id: _Optional[str] = ..., policy_version: _Optional[int] = ..., group_name: _Optional[str] = ..., rendezvous: _Optional[str] = ..., backend: _Optional[str] = ..., world_size: _Optional[int] = ..., buckets: _Optional[_Iterable[_Union[BroadcastBucket, _Mapping]]] = ..., tensors: _Optional[int] = ..., bytes: _Optional[int] = ..., lora: _Optional[_Union[LoraAdapter, _Mapping]] = ..., digest_trailer: _Optional[bool] = ...) -> None: ...

class ReceiveWeightsRequest(_message.Message):
    __slots__ = ("plan", "rank")
    PLAN_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    plan: BroadcastPlan
    rank: int
    def __init__(self, plan: _Optional[_Union[BroadcastPlan, _Mapping]] = ..., rank: _Optional[int] = ...) -> None: ...

class IpcTensor(_message.Message):
    __slots__ = ("name", "dtype", "shape", "offset")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ...) -> None: ...

class IpcBucket(_message.Message):
    __slots__ = ("nbytes", "tensors", "handle", "storage_size_bytes", "storage_offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required", "shm_manager", "shm_name")
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    SHM_MANAGER_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    nbytes: int
    tensors: _containers.RepeatedCompositeFieldContainer[IpcTensor]
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    shm_manager: bytes
    shm_name: bytes
    def __init__(self, nbytes: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[IpcTensor, _Mapping]]] = ..., handle: _Optional[bytes] = ..., storage_size_bytes: _Optional[int] = ..., storage_offset_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ..., shm_manager: _Optional[bytes] = ..., shm_name: _Optional[bytes] = ...) -> None: ...

class OpenWeightHandoverRequest(_message.Message):
    __slots__ = ("run_id", "replicas", "bucket_bytes")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    BUCKET_BYTES_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    replicas: int
    bucket_bytes: int
    def __init__(self, run_id: _Optional[str] = ..., replicas: _Optional[int] = ..., bucket_bytes: _Optional[int] = ...) -> None: ...

class WeightHandover(_message.Message):
    __slots__ = ("run_id", "policy_version", "handover_id", "backend", "device_uuid", "tensors", "bytes", "buckets", "node_id")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    HANDOVER_ID_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    policy_version: int
    handover_id: str
    backend: str
    device_uuid: str
    tensors: int
    bytes: int
    buckets: int
    node_id: str
    def __init__(self, run_id: _Optional[str] = ..., policy_version: _Optional[int] = ..., handover_id: _Optional[str] = ..., backend: _Optional[str] = ..., device_uuid: _Optional[str] = ..., tensors: _Optional[int] = ..., bytes: _Optional[int] = ..., buckets: _Optional[int] = ..., node_id: _Optional[str] = ...) -> None: ...

class MapWeightsRequest(_message.Message):
    __slots__ = ("run_id", "policy_version", "handover_id", "trainer_address")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    HANDOVER_ID_FIELD_NUMBER: _ClassVar[int]
    TRAINER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    policy_version: int
    handover_id: str
    trainer_address: str
    def __init__(self, run_id: _Optional[str] = ..., policy_version: _Optional[int] = ..., handover_id: _Optional[str] = ..., trainer_address: _Optional[str] = ...) -> None: ...

class GetWeightHandlesRequest(_message.Message):
    __slots__ = ("run_id", "policy_version", "handover_id", "node_id", "device_uuids")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    HANDOVER_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUIDS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    policy_version: int
    handover_id: str
    node_id: str
    device_uuids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, run_id: _Optional[str] = ..., policy_version: _Optional[int] = ..., handover_id: _Optional[str] = ..., node_id: _Optional[str] = ..., device_uuids: _Optional[_Iterable[str]] = ...) -> None: ...

class WeightHandles(_message.Message):
    __slots__ = ("run_id", "policy_version", "handover_id", "share_id", "backend", "device_uuid", "node_id", "buckets", "tensors", "bytes", "lora")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    HANDOVER_ID_FIELD_NUMBER: _ClassVar[int]
    SHARE_ID_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    policy_version: int
    handover_id: str
    share_id: str
    backend: str
    device_uuid: str
    node_id: str
    buckets: _containers.RepeatedCompositeFieldContainer[IpcBucket]
    tensors: int
    bytes: int
    lora: LoraAdapter
    def __init__(self, run_id: _Optional[str] = ..., policy_version: _Optional[int] = ..., handover_id: _Optional[str] = ..., share_id: _Optional[str] = ..., backend: _Optional[str] = ..., device_uuid: _Optional[str] = ..., node_id: _Optional[str] = ..., buckets: _Optional[_Iterable[_Union[IpcBucket, _Mapping]]] = ..., tensors: _Optional[int] = ..., bytes: _Optional[int] = ..., lora: _Optional[_Union[LoraAdapter, _Mapping]] = ...) -> None: ...

class VerifyWeightHandoverRequest(_message.Message):
    __slots__ = ("run_id", "handover_id", "share_id", "total_sha256")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    HANDOVER_ID_FIELD_NUMBER: _ClassVar[int]
    SHARE_ID_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SHA256_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    handover_id: str
    share_id: str
    total_sha256: str
    def __init__(self, run_id: _Optional[str] = ..., handover_id: _Optional[str] = ..., share_id: _Optional[str] = ..., total_sha256: _Optional[str] = ...) -> None: ...

class VerifyWeightHandoverResponse(_message.Message):
    __slots__ = ("total_sha256",)
    TOTAL_SHA256_FIELD_NUMBER: _ClassVar[int]
    total_sha256: str
    def __init__(self, total_sha256: _Optional[str] = ...) -> None: ...

class ReleaseWeightHandlesRequest(_message.Message):
    __slots__ = ("run_id", "handover_id", "share_id", "mapped_buckets")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    HANDOVER_ID_FIELD_NUMBER: _ClassVar[int]
    SHARE_ID_FIELD_NUMBER: _ClassVar[int]
    MAPPED_BUCKETS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    handover_id: str
    share_id: str
    mapped_buckets: int
    def __init__(self, run_id: _Optional[str] = ..., handover_id: _Optional[str] = ..., share_id: _Optional[str] = ..., mapped_buckets: _Optional[int] = ...) -> None: ...

class ReleaseWeightHandlesResponse(_message.Message):
    __slots__ = ("outstanding",)
    OUTSTANDING_FIELD_NUMBER: _ClassVar[int]
    outstanding: int
    def __init__(self, outstanding: _Optional[int] = ...) -> None: ...

class CloseWeightHandoverRequest(_message.Message):
    __slots__ = ("run_id", "handover_id")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    HANDOVER_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    handover_id: str
    def __init__(self, run_id: _Optional[str] = ..., handover_id: _Optional[str] = ...) -> None: ...

class CloseWeightHandoverResponse(_message.Message):
    __slots__ = ("unreleased",)
    UNRELEASED_FIELD_NUMBER: _ClassVar[int]
    unreleased: int
    def __init__(self, unreleased: _Optional[int] = ...) -> None: ...

class ScoreItem(_message.Message):
    __slots__ = ("item_id", "prompt", "response", "reference")
    ITEM_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    item_id: str
    prompt: str
    response: str
    reference: str
    def __init__(self, item_id: _Optional[str] = ..., prompt: _Optional[str] = ..., response: _Optional[str] = ..., reference: _Optional[str] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("run_id", "items", "judge_template", "max_new_tokens", "call_id")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    JUDGE_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    items: _containers.RepeatedCompositeFieldContainer[ScoreItem]
    judge_template: str
    max_new_tokens: int
    call_id: str
    def __init__(self, run_id: _Optional[str] = ..., items: _Optional[_Iterable[_Union[ScoreItem, _Mapping]]] = ..., judge_template: _Optional[str] = ..., max_new_tokens: _Optional[int] = ..., call_id: _Optional[str] = ...) -> None: ...

class ScoreResult(_message.Message):
    __slots__ = ("item_id", "score", "verdict")
    ITEM_ID_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    item_id: str
    score: float
    verdict: str
    def __init__(self, item_id: _Optional[str] = ..., score: _Optional[float] = ..., verdict: _Optional[str] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("results", "weights_sha256", "engine", "call_id")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_SHA256_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ScoreResult]
    weights_sha256: str
    engine: str
    call_id: str
    def __init__(self, results: _Optional[_Iterable[_Union[ScoreResult, _Mapping]]] = ..., weights_sha256: _Optional[str] = ..., engine: _Optional[str] = ..., call_id: _Optional[str] = ...) -> None: ...

class ConfigureRunRequest(_message.Message):
    __slots__ = ("run_id", "model_path", "seed", "trainer_config_json", "resume_checkpoint")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TRAINER_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    RESUME_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    model_path: str
    seed: int
    trainer_config_json: str
    resume_checkpoint: str
    def __init__(self, run_id: _Optional[str] = ..., model_path: _Optional[str] = ..., seed: _Optional[int] = ..., trainer_config_json: _Optional[str] = ..., resume_checkpoint: _Optional[str] = ...) -> None: ...

class ConfigureRunResponse(_message.Message):
    __slots__ = ("info",)
    INFO_FIELD_NUMBER: _ClassVar[int]
    info: ServiceInfo
    def __init__(self, info: _Optional[_Union[ServiceInfo, _Mapping]] = ...) -> None: ...

class Trajectory(_message.Message):
    __slots__ = ("run_id", "step", "policy_version", "group_id", "sample_id", "prompt_token_ids", "response_token_ids", "rollout_logprobs", "reward", "advantage", "finish_reason", "token_policy_versions", "response_mask", "episode", "routed_experts")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGE_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TOKEN_POLICY_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_MASK_FIELD_NUMBER: _ClassVar[int]
    EPISODE_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    step: int
    policy_version: int
    group_id: str
    sample_id: str
    prompt_token_ids: Tensor
    response_token_ids: Tensor
    rollout_logprobs: Tensor
    reward: float
    advantage: float
    finish_reason: str
    token_policy_versions: _containers.RepeatedScalarFieldContainer[int]
    response_mask: Tensor
    episode: EpisodeRecord
    routed_experts: Tensor
    def __init__(self, run_id: _Optional[str] = ..., step: _Optional[int] = ..., policy_version: _Optional[int] = ..., group_id: _Optional[str] = ..., sample_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Union[Tensor, _Mapping]] = ..., response_token_ids: _Optional[_Union[Tensor, _Mapping]] = ..., rollout_logprobs: _Optional[_Union[Tensor, _Mapping]] = ..., reward: _Optional[float] = ..., advantage: _Optional[float] = ..., finish_reason: _Optional[str] = ..., token_policy_versions: _Optional[_Iterable[int]] = ..., response_mask: _Optional[_Union[Tensor, _Mapping]] = ..., episode: _Optional[_Union[EpisodeRecord, _Mapping]] = ..., routed_experts: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class EpisodeRecord(_message.Message):
    __slots__ = ("turns", "turn_rewards", "tool_calls", "tool_errors", "end_reason")
    TURNS_FIELD_NUMBER: _ClassVar[int]
    TURN_REWARDS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_ERRORS_FIELD_NUMBER: _ClassVar[int]
    END_REASON_FIELD_NUMBER: _ClassVar[int]
    turns: int
    turn_rewards: _containers.RepeatedScalarFieldContainer[float]
    tool_calls: int
    tool_errors: int
    end_reason: str
    def __init__(self, turns: _Optional[int] = ..., turn_rewards: _Optional[_Iterable[float]] = ..., tool_calls: _Optional[int] = ..., tool_errors: _Optional[int] = ..., end_reason: _Optional[str] = ...) -> None: ...

class TrainStepHeader(_message.Message):
    __slots__ = ("run_id", "step", "policy_version", "num_trajectories", "max_staleness", "streaming", "keep_previous_weights")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    STREAMING_FIELD_NUMBER: _ClassVar[int]
    KEEP_PREVIOUS_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    step: int
    policy_version: int
    num_trajectories: int
    max_staleness: int
    streaming: bool
    keep_previous_weights: bool
    def __init__(self, run_id: _Optional[str] = ..., step: _Optional[int] = ..., policy_version: _Optional[int] = ..., num_trajectories: _Optional[int] = ..., max_staleness: _Optional[int] = ..., streaming: _Optional[bool] = ..., keep_previous_weights: _Optional[bool] = ...) -> None: ...

class TrainStepChunk(_message.Message):
    __slots__ = ("header", "trajectory")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORY_FIELD_NUMBER: _ClassVar[int]
    header: TrainStepHeader
    trajectory: Trajectory
    def __init__(self, header: _Optional[_Union[TrainStepHeader, _Mapping]] = ..., trajectory: _Optional[_Union[Trajectory, _Mapping]] = ...) -> None: ...

class StepMetrics(_message.Message):
    __slots__ = ("run_id", "step", "policy_version", "metrics", "replayed", "sample_weights")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    step: int
    policy_version: int
    metrics: _containers.ScalarMap[str, float]
    replayed: bool
    sample_weights: _containers.RepeatedCompositeFieldContainer[SampleWeights]
    def __init__(self, run_id: _Optional[str] = ..., step: _Optional[int] = ..., policy_version: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ..., replayed: _Optional[bool] = ..., sample_weights: _Optional[_Iterable[_Union[SampleWeights, _Mapping]]] = ...) -> None: ...

class SampleWeights(_message.Message):
    __slots__ = ("sample_id", "iw_min", "iw_max")
    SAMPLE_ID_FIELD_NUMBER: _ClassVar[int]
    IW_MIN_FIELD_NUMBER: _ClassVar[int]
    IW_MAX_FIELD_NUMBER: _ClassVar[int]
    sample_id: str
    iw_min: float
    iw_max: float
    def __init__(self, sample_id: _Optional[str] = ..., iw_min: _Optional[float] = ..., iw_max: _Optional[float] = ...) -> None: ...

class ParityToken(_message.Message):
    __slots__ = ("sample_id", "position", "logp", "rollout_logp")
    SAMPLE_ID_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    LOGP_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_LOGP_FIELD_NUMBER: _ClassVar[int]
    sample_id: str
    position: int
    logp: float
    rollout_logp: float
    def __init__(self, sample_id: _Optional[str] = ..., position: _Optional[int] = ..., logp: _Optional[float] = ..., rollout_logp: _Optional[float] = ...) -> None: ...

class ParityReport(_message.Message):
    __slots__ = ("passed", "message", "stats", "worst_tokens", "attention_backend", "logprob_backend")
    class StatsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    PASSED_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    WORST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_BACKEND_FIELD_NUMBER: _ClassVar[int]
    passed: bool
    message: str
    stats: _containers.ScalarMap[str, float]
    worst_tokens: _containers.RepeatedCompositeFieldContainer[ParityToken]
    attention_backend: str
    logprob_backend: str
    def __init__(self, passed: _Optional[bool] = ..., message: _Optional[str] = ..., stats: _Optional[_Mapping[str, float]] = ..., worst_tokens: _Optional[_Iterable[_Union[ParityToken, _Mapping]]] = ..., attention_backend: _Optional[str] = ..., logprob_backend: _Optional[str] = ...) -> None: ...

class GetWeightsRequest(_message.Message):
    __slots__ = ("run_id", "chunk_bytes", "policy_version")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    chunk_bytes: int
    policy_version: int
    def __init__(self, run_id: _Optional[str] = ..., chunk_bytes: _Optional[int] = ..., policy_version: _Optional[int] = ...) -> None: ...

class SaveCheckpointRequest(_message.Message):
    __slots__ = ("run_id", "directory")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    directory: str
    def __init__(self, run_id: _Optional[str] = ..., directory: _Optional[str] = ...) -> None: ...

class SaveCheckpointResponse(_message.Message):
    __slots__ = ("directory", "policy_version")
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    directory: str
    policy_version: int
    def __init__(self, directory: _Optional[str] = ..., policy_version: _Optional[int] = ...) -> None: ...

class WriteWeightsRequest(_message.Message):
    __slots__ = ("run_id", "directory", "policy_version")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    directory: str
    policy_version: int
    def __init__(self, run_id: _Optional[str] = ..., directory: _Optional[str] = ..., policy_version: _Optional[int] = ...) -> None: ...

class WriteWeightsResponse(_message.Message):
    __slots__ = ("directory", "policy_version", "tensors", "bytes", "total_sha256")
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SHA256_FIELD_NUMBER: _ClassVar[int]
    directory: str
    policy_version: int
    tensors: int
    bytes: int
    total_sha256: str
    def __init__(self, directory: _Optional[str] = ..., policy_version: _Optional[int] = ..., tensors: _Optional[int] = ..., bytes: _Optional[int] = ..., total_sha256: _Optional[str] = ...) -> None: ...

class LoadCheckpointRequest(_message.Message):
    __slots__ = ("run_id", "directory")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    directory: str
    def __init__(self, run_id: _Optional[str] = ..., directory: _Optional[str] = ...) -> None: ...

class LoadCheckpointResponse(_message.Message):
    __slots__ = ("policy_version",)
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    def __init__(self, policy_version: _Optional[int] = ...) -> None: ...

class OpenWeightBroadcastRequest(_message.Message):
    __slots__ = ("run_id", "replicas", "bucket_bytes", "digest_trailer")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    BUCKET_BYTES_FIELD_NUMBER: _ClassVar[int]
    DIGEST_TRAILER_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    replicas: int
    bucket_bytes: int
    digest_trailer: bool
    def __init__(self, run_id: _Optional[str] = ..., replicas: _Optional[int] = ..., bucket_bytes: _Optional[int] = ..., digest_trailer: _Optional[bool] = ...) -> None: ...

class RunWeightBroadcastRequest(_message.Message):
    __slots__ = ("run_id", "group_name")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_NAME_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    group_name: str
    def __init__(self, run_id: _Optional[str] = ..., group_name: _Optional[str] = ...) -> None: ...

class AbortWeightBroadcastRequest(_message.Message):
    __slots__ = ("run_id", "group_name", "reason")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_NAME_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    group_name: str
    reason: str
    def __init__(self, run_id: _Optional[str] = ..., group_name: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class AbortWeightBroadcastResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: bool
    def __init__(self, aborted: _Optional[bool] = ...) -> None: ...
