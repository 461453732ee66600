"""`sao convert verify` as a script (for torchrun / srun): `python tools/convert_verify.py --help`."""

import sys

from megatron_sao.jobs.convert_parser import main

if __name__ == "__main__":  # the torch_dist writer starts a spawn Manager that re-imports __main__
    sys.exit(main(["convert", "verify", *sys.argv[1:]]))
