"""Names of the model zoo, importable without torch.

``flowerbed.models.MODELS`` (which needs torch) holds exactly these models, in this
order (a test checks); command lines and run-config checks list and check the names
from here, so ``--help`` and a config check import no torch.
"""

MODEL_NAMES = ("lenet", "mobilenet", "mobilenetv2", "cnn1d", "mlp", "logreg")
"""Models a run can name."""
ONE_D_MODELS = ("cnn1d", "mlp", "logreg")
"""The models that take sequences (N x C x L), not images (a test checks against
``flowerbed.models.model_dims``)."""
