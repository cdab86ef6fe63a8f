"""The model zoo: ``zoo`` (names -> local HF folders, loading policies, value models and
tokenizers; nothing is downloaded at run time), ``tiny`` (random Qwen2 / Qwen2-VL models
built locally in seconds) and ``vision`` (image inputs for VL models). It may import
``agentgym.core``.

``from agentgym.models import resolve_model`` (the module this package replaced) still
works for one release, with a DeprecationWarning; import from ``agentgym.models.zoo``.
"""

from agentgym._compat import deprecated_attributes

__getattr__ = deprecated_attributes(__name__, "agentgym.models.zoo")
