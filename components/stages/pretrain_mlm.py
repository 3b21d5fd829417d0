"""Stage body of `pretrain_mlm` under torchrun (see components/stages/pretrain_retromae.py)."""

from components.stages.common import torchrun_worker
from components.stages.pretrain_retromae import train_encoder


def main() -> None:
    torchrun_worker("pretrain_mlm", lambda params, run: train_encoder("pretrain_mlm", params, run))


if __name__ == "__main__":
    main()
