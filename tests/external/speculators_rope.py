"""Run inside the separate speculators venv (tests/test_rope.py): load an export with the ``speculators``
package's own ``DFlashDraftModel.from_pretrained`` and write the rotary embedding it built.

    python speculators_rope.py EXPORT_DIR OUTPUT.safetensors

OUTPUT gets ``inv_freq`` [d/2] (the module's buffer, as transformers computed it), ``attention_scaling``
[1] (float64) and ``rope_type`` (utf-8 bytes) of every rotary module the model holds (they must agree:
``count`` [1]). Nothing from dflash_trainer is imported here.
"""

import sys

import torch
from safetensors.torch import save_file
from speculators.models.dflash import DFlashDraftModel

model = DFlashDraftModel.from_pretrained(sys.argv[1])
rotaries = [m for m in model.modules() if hasattr(m, "inv_freq") and hasattr(m, "attention_scaling")]
assert rotaries, "no rotary embedding module in the loaded model"
first = rotaries[0]
for other in rotaries[1:]:
    assert torch.equal(other.inv_freq, first.inv_freq) and other.attention_scaling == first.attention_scaling
save_file(
    {
        "inv_freq": first.inv_freq.detach().contiguous(),
        "attention_scaling": torch.tensor([float(first.attention_scaling)], dtype=torch.float64),
        "rope_type": torch.tensor(list(first.rope_type.encode()), dtype=torch.uint8),
        "count": torch.tensor([len(rotaries)]),
    },
    sys.argv[2],
)
