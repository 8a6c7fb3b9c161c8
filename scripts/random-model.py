"""An mlx-lm model folder with the architecture of a given one and random
weights: for speed runs where the real weights cannot travel.

    python3 scripts/random-model.py SOURCE_FOLDER OUT_FOLDER [--dtype bfloat16]

SOURCE_FOLDER needs config.json and the tokenizer files; its weights are not read.
"""

import argparse
import json
import shutil
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("source")
    ap.add_argument("out")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    args = ap.parse_args()
    src, out = Path(args.source), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    config["torch_dtype"] = args.dtype
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))  # random initialisation
    model.set_dtype(getattr(mx, args.dtype))
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("chat_template.jinja", "special_tokens_map.json"):
            shutil.copy(f, out / f.name)
    print(f"random {config['model_type']} ({args.dtype}) in {out}")


if __name__ == "__main__":
    main()
