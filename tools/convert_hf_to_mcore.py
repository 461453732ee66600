"""`sao convert hf-to-mcore` as a script (for torchrun / srun): `python tools/convert_hf_to_mcore.py --help`."""

import sys

from megatron_sao.jobs.convert_parser import main

if __name__ == "__main__":  # the torch_dist writer starts a spawn Manager that re-imports __main__
    sys.exit(main(["convert", "hf-to-mcore", *sys.argv[1:]]))
