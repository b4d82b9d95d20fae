"""`python -m trainer --config runs/RUN/config.yaml`: see trainer.train."""

import sys

from trainer.train import main

if __name__ == "__main__":
    sys.exit(main())
