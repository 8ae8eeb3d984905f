"""Write ``engine/spec/sequence_classification.py``: the model types that transformers has a sequence-classification
class for, so that the API (which never imports transformers) can refuse a reward model without one at submit.

Run after upgrading transformers: ``python scripts/sequence_classification_types.py``;
tests/engine/test_sequence_classification.py fails while the list differs from the installed transformers'.
"""

from pathlib import Path

import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES

TARGET = Path(__file__).resolve().parent.parent / "engine" / "spec" / "sequence_classification.py"


def render(model_types: list[str]) -> str:
    lines = "".join(f'        "{name}",\n' for name in sorted(model_types))
    return (
        '"""The model types (``model_type`` of a config.json) that transformers has a sequence-classification class\n'
        "for: the architectures that can be trained as a reward model or critic. Torch-free, for the API's checks at\n"
        f"submit. Generated from transformers {transformers.__version__} by\n"
        "scripts/sequence_classification_types.py; do not edit.\n"
        '"""\n\n'
        "SEQUENCE_CLASSIFICATION_TYPES = frozenset(\n"
        "    (\n"
        f"{lines}"
        "    )\n"
        ")\n"
    )


def main() -> None:
    TARGET.write_text(render(list(MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES)))
    print(f"wrote {TARGET} ({len(MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES)} model types)")


if __name__ == "__main__":
    main()
