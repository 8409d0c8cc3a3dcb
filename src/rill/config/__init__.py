"""Server configuration: frozen per-area dataclasses and the one loader.

Precedence: command-line flags > ``RILL_*`` environment variables > a TOML config file
(``--config``) > defaults. ``load()`` is the only place in rill that reads ``os.environ``
for settings (with ``sampling_defaults()``, the batch ``/ws`` defaults); deeper code
receives these objects.

The package's modules, each re-exported here (``rill.config.X`` is the path to use):

* ``areas``: the settings of each area (``EngineConfig``, ``HttpConfig``, ...) composed
  into ``ServerConfig``; each field's ``help`` becomes its ``--flag`` help;
* ``loader``: flags, environment and TOML file → ``ServerConfig`` (``add_arguments``, ``load``);
* ``checks``: the checks across fields (``validate``);
* ``values``: sizes, API keys and typed values from text;
* ``batch_defaults``: the batch ``/ws`` generation defaults (``SamplingDefaults``).
"""

from __future__ import annotations

from rill.config.areas import (
    AREAS,
    FORMER_AREAS,
    BatchWsConfig,
    ChatConfig,
    ClusterConfig,
    ConnectionConfig,
    EmbeddingConfig,
    EngineConfig,
    EvergreenConfig,
    HttpConfig,
    PolicyConfig,
    ResumeConfig,
    ServerConfig,
    SpeechConfig,
    StorageConfig,
    UdsConfig,
    embedding_model_name,
    served_model_name,
    session_memory_bytes,
)
from rill.config.batch_defaults import SamplingDefaults, sampling_defaults
from rill.config.checks import validate
from rill.config.loader import add_arguments, load
from rill.config.values import check_api_key, parse_size

__all__ = [
    "AREAS",
    "FORMER_AREAS",
    "BatchWsConfig",
    "ChatConfig",
    "ClusterConfig",
    "ConnectionConfig",
    "EmbeddingConfig",
    "EngineConfig",
    "EvergreenConfig",
    "HttpConfig",
    "PolicyConfig",
    "ResumeConfig",
    "SamplingDefaults",
    "ServerConfig",
    "SpeechConfig",
    "StorageConfig",
    "UdsConfig",
    "add_arguments",
    "check_api_key",
    "embedding_model_name",
    "load",
    "parse_size",
    "sampling_defaults",
    "served_model_name",
    "session_memory_bytes",
    "validate",
]
