"""Reference values for tests/test_brisque.py from OpenCV's own BRISQUE (opencv_contrib's
cv::quality::QualityBRISQUE, a port of LIVE's C++ release).

Two steps, in two environments, because opencv-contrib cannot sit beside the opencv-python-headless
that pixrl's extras install:

  .venv/bin/python benchmarks/brisque_reference.py images
      crops of scikit-image's bundled photographs (chelsea, astronaut, coffee) and distorted copies
      (Gaussian blur, additive noise, JPEG at quality 10) → tests/data/brisque_images.npz

  python -m venv /tmp/cvc && /tmp/cvc/bin/pip install numpy opencv-contrib-python-headless
  apt-get download opencv-data && dpkg -x opencv-data_*.deb /tmp/ocvdata
  /tmp/cvc/bin/python benchmarks/brisque_reference.py opencv --quality /tmp/ocvdata/usr/share/opencv4/quality
      OpenCV's 36 features and its score (brisque_model_live.yml) per image → tests/data/brisque_opencv.json
"""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path

import numpy as np

DATA = Path(__file__).resolve().parents[1] / "tests" / "data"


def images() -> None:
    import skimage.data
    from PIL import Image
    from scipy.ndimage import gaussian_filter

    chelsea = skimage.data.chelsea()[70:182, 140:284]
    out = {"chelsea": chelsea, "astronaut": skimage.data.astronaut()[30:142, 170:314],
           "coffee": skimage.data.coffee()[120:232, 180:324]}
    out["chelsea_blur2"] = np.stack([gaussian_filter(chelsea[..., c].astype(np.float64), 2.0) for c in range(3)],
                                    -1).round().clip(0, 255).astype(np.uint8)
    noise = np.random.default_rng(0).normal(0, 20, chelsea.shape)
    out["chelsea_noise20"] = (chelsea + noise).round().clip(0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(chelsea).save(buf, "JPEG", quality=10)
    out["chelsea_jpeg10"] = np.asarray(Image.open(buf).convert("RGB"))
    np.savez_compressed(DATA / "brisque_images.npz", **out)
    print({k: v.shape for k, v in out.items()})


def opencv(quality: Path) -> None:
    import cv2

    imgs = np.load(DATA / "brisque_images.npz")
    model, rng = str(quality / "brisque_model_live.yml"), str(quality / "brisque_range_live.yml")
    out = {"opencv": cv2.__version__, "images": {}}
    for name in imgs.files:
        bgr = np.ascontiguousarray(imgs[name][..., ::-1])
        out["images"][name] = {
            "score": float(cv2.quality.QualityBRISQUE_compute(bgr, model, rng)[0]),
            "features": [float(x) for x in cv2.quality.QualityBRISQUE_computeFeatures(bgr).ravel()]}
    (DATA / "brisque_opencv.json").write_text(json.dumps(out, indent=1))
    print({k: round(v["score"], 3) for k, v in out["images"].items()})


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("step", choices=["images", "opencv"])
    ap.add_argument("--quality", type=Path, default=Path("/usr/share/opencv4/quality"))
    a = ap.parse_args()
    images() if a.step == "images" else opencv(a.quality)
