"""The engine: one model replica decoding many prompts (requests, sessions, sequences)."""
from logitspec.engine.engine import Engine, EngineRun
from logitspec.engine.request import Request
from logitspec.engine.sequence import GenerationResult

__all__ = ["Engine", "EngineRun", "GenerationResult", "Request"]
