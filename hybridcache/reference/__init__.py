"""Reference generations to compare against: HF transformers (live), vLLM (subprocess), recorded JSONL files."""

from hybridcache.reference.base import (
    Generation,
    MalformedGeneration,
    ReferenceAnswerError,
    ReferenceRunner,
    generation_from_logits,
)
from hybridcache.reference.file import FileRunner, RecordingMismatch, write_jsonl
from hybridcache.reference.hf import HFRunner
from hybridcache.reference.vllm_runner import VLLMRunner

__all__ = [
    "FileRunner",
    "Generation",
    "MalformedGeneration",
    "ReferenceAnswerError",
    "RecordingMismatch",
    "HFRunner",
    "ReferenceRunner",
    "VLLMRunner",
    "generation_from_logits",
    "write_jsonl",
]
