"""BRISQUE (Mittal, Moorthy & Bovik, IEEE TIP 2012): no-reference image quality from natural-scene
statistics. The grey image's MSCN coefficients (I − μ)/(σ + 1/255) under a 7×7 Gaussian (σ 7/6)
and their products with the right, lower, lower-right and upper-right neighbours are each fitted
with an asymmetric generalised Gaussian (shape by grid search over 0.2…10 in steps of 0.001, left
and right variances, and for the products the mean); 18 numbers at full and 18 at half size,
scaled into [−1, 1] by the training range, go through the LIVE-trained ε-SVR (RBF kernel). The
score is 0 (best) … 100 (worst); the reward is 1 − score/100 (`brisque.raw` keeps the score).

The features are those of LIVE's C++ release as OpenCV's `cv::quality::QualityBRISQUE` ports it
(grey by BGR2GRAY, blur with replicated borders, zeros past the edge for the shifted products,
bicubic half-size, float32) — tests/test_brisque.py checks them against values OpenCV computed.
The model (`model`): by default the LIVE SVR shipped in the `brisque` wheel (models/svm.txt, a
libsvm model, with models/normalize.pickle), read without importing that package; or OpenCV's
pair (brisque_model_live.yml + `range` brisque_range_live.yml, Debian's `opencv-data`). BRISQUE
is meant for natural images: flat synthetic scenes score oddly.
"""

from __future__ import annotations

import importlib.util
from functools import lru_cache
from pathlib import Path

import numpy as np

from .base import Reward, ScoringError, register_reward

SHIFTS = ((0, 1), (1, 0), (1, 1), (-1, 1))  # right, down, down-right, up-right


@lru_cache(maxsize=1)
def _gamma_grid() -> tuple[np.ndarray, np.ndarray]:
    """The shapes the C++ release tries (0.2, 0.201, … by repeated addition, as its loop does)
    and ρ(γ) = Γ(2/γ)² / (Γ(1/γ)·Γ(3/γ)) for each."""
    from scipy.special import gamma

    grid, g = [], 0.2
    while g < 10:
        grid.append(g)
        g += 0.001
    grid = np.array(grid)
    return grid, gamma(2 / grid) ** 2 / (gamma(1 / grid) * gamma(3 / grid))


def aggd_fit(x: np.ndarray) -> tuple[float, float, float]:
    """(shape γ, left σ, right σ) of an asymmetric generalised Gaussian fitted by moments:
    σ_l² = mean of x² over x < 0, σ_r² over x > 0 (zeros count in neither but in the total),
    r̂ = E|x|² / E[x²], R̂ = r̂(ĝ³+1)(ĝ+1)/(ĝ²+1)² with ĝ = σ_l/σ_r, and γ the first grid point
    after which |ρ(γ) − R̂| grows."""
    x = x.astype(np.float32).ravel()  # squares in float32, sums in float64, as OpenCV's port
    neg, pos = x[x < 0], x[x > 0]
    if not len(neg) or not len(pos):
        raise ScoringError("BRISQUE: the image has no contrast to fit (MSCN coefficients all of one sign); "
                           "BRISQUE needs a natural image")
    negsq, possq = float(np.sum(neg * neg, dtype=np.float64)), float(np.sum(pos * pos, dtype=np.float64))
    lsigma, rsigma = (negsq / len(neg)) ** 0.5, (possq / len(pos)) ** 0.5
    ghat = lsigma / rsigma
    rhat = (float(np.sum(np.abs(x), dtype=np.float64)) / len(x)) ** 2 / ((negsq + possq) / len(x))
    rhatnorm = rhat * (ghat ** 3 + 1) * (ghat + 1) / (ghat ** 2 + 1) ** 2
    grid, rho = _gamma_grid()
    diff = np.abs(rho - rhatnorm)
    rising = np.nonzero(diff[1:] > diff[:-1])[0]
    return float(grid[rising[0]] if len(rising) else grid[-1]), lsigma, rsigma


def mscn(gray: np.ndarray) -> np.ndarray:
    """Mean-subtracted contrast-normalised coefficients of a float32 grey image in [0, 1]. Where
    the local variance E[I²] − μ² rounds below zero the patch is flat and its coefficient is 0
    (OpenCV's port takes the square root of the negative number there, gets NaN, and its fits
    drop those pixels from both sides while counting them in the total: the same thing)."""
    import cv2

    mu = cv2.GaussianBlur(gray, (7, 7), 7 / 6, 0, borderType=cv2.BORDER_REPLICATE)
    var = cv2.GaussianBlur(gray * gray, (7, 7), 7 / 6, 0, borderType=cv2.BORDER_REPLICATE) - mu * mu
    flat = var < 0
    out = (gray - mu) / (np.sqrt(np.where(flat, np.float32(0), var)) + np.float32(1 / 255))
    out[flat] = 0
    return out


def shifted_product(s: np.ndarray, dy: int, dx: int) -> np.ndarray:
    """s(i, j)·s(i+dy, j+dx), 0 where the neighbour is past the edge."""
    h, w = s.shape
    shifted = np.zeros_like(s)
    ys, yd = (slice(dy, h), slice(0, h - dy)) if dy >= 0 else (slice(0, h + dy), slice(-dy, h))
    xs, xd = (slice(dx, w), slice(0, w - dx)) if dx >= 0 else (slice(0, w + dx), slice(-dx, w))
    shifted[yd, xd] = s[ys, xs]
    return s * shifted


def features(image: np.ndarray) -> np.ndarray:
    """uint8 RGB [H, W, 3] → the 36 BRISQUE features (float32)."""
    import cv2
    from scipy.special import gamma as G

    gray = cv2.cvtColor(np.ascontiguousarray(image[..., ::-1]), cv2.COLOR_BGR2GRAY).astype(np.float32) / np.float32(255)
    out = []
    for scale in (1, 2):
        h, w = gray.shape
        img = gray if scale == 1 else cv2.resize(gray, (w // 2, h // 2), interpolation=cv2.INTER_CUBIC)
        s = mscn(img)
        g, l, r = aggd_fit(s)
        out += [g, (l * l + r * r) / 2]
        for dy, dx in SHIFTS:
            g, l, r = aggd_fit(shifted_product(s, dy, dx))
            mean = (r - l) * (G(2 / g) / G(1 / g)) * (G(1 / g) ** 0.5 / G(3 / g) ** 0.5)
            out += [g, mean, l * l, r * r]
    return np.array(out, np.float32)


class SVR:
    """An ε-SVR with an RBF kernel: f(x) = Σ αᵢ·exp(−γ‖x − svᵢ‖²) − ρ, after scaling x into
    [−1, 1] with the training range (lo, hi per feature)."""

    def __init__(self, sv: np.ndarray, alpha: np.ndarray, rho: float, gamma: float, lo: np.ndarray, hi: np.ndarray):
        self.sv, self.alpha, self.rho, self.gamma = sv, alpha, rho, gamma
        self.lo, self.hi = lo, hi

    def __call__(self, feats: np.ndarray) -> float:
        x = -1 + 2 * (feats.astype(np.float64) - self.lo) / (self.hi - self.lo)
        k = np.exp(-self.gamma * np.sum((self.sv - x) ** 2, axis=1))
        return float(self.alpha @ k - self.rho)

    @classmethod
    def libsvm(cls, model: Path, scale: Path) -> "SVR":
        """A libsvm text model (epsilon_svr, rbf) and a pickled {"min_": […], "max_": […]}."""
        from .wire import restricted_loads

        header, sv, alpha = {}, [], []
        lines = model.read_text().splitlines()
        body = lines.index("SV")
        for line in lines[:body]:
            key, *value = line.split()
            header[key] = value
        if header.get("svm_type") != ["epsilon_svr"] or header.get("kernel_type") != ["rbf"]:
            raise ValueError(f"{model}: not an epsilon-SVR with an RBF kernel ({header.get('svm_type')}, "
                             f"{header.get('kernel_type')})")
        rng = restricted_loads(scale.read_bytes())
        n = len(rng["min_"])
        for line in lines[body + 1:]:
            if line.strip():
                coef, *pairs = line.split()
                row = np.zeros(n)
                for p in pairs:
                    i, v = p.split(":")
                    row[int(i) - 1] = float(v)
                alpha.append(float(coef))
                sv.append(row)
        return cls(np.array(sv), np.array(alpha), float(header["rho"][0]), float(header["gamma"][0]),
                   np.array(rng["min_"], np.float64), np.array(rng["max_"], np.float64))

    @classmethod
    def opencv(cls, model: Path, scale: Path) -> "SVR":
        """OpenCV's ml::SVM YAML (EPS_SVR, RBF) and its range YAML (row 0 min, row 1 max)."""
        import cv2

        fs = cv2.FileStorage(str(model), cv2.FILE_STORAGE_READ)
        root = fs.getNode("opencv_ml_svm")
        if root.empty() or root.getNode("svmType").string() != "EPS_SVR" or \
                root.getNode("kernel").getNode("type").string() != "RBF":
            raise ValueError(f"{model}: not an OpenCV EPS_SVR model with an RBF kernel")
        svn = root.getNode("support_vectors")
        sv = np.array([[svn.at(i).at(j).real() for j in range(svn.at(i).size())] for i in range(svn.size())])
        df = root.getNode("decision_functions").at(0)
        an = df.getNode("alpha")
        alpha = np.array([an.at(i).real() for i in range(an.size())])
        if not df.getNode("index").empty():
            idx = df.getNode("index")
            sv = sv[[int(idx.at(i).real()) for i in range(idx.size())]]
        range_fs = cv2.FileStorage(str(scale), cv2.FILE_STORAGE_READ)  # keep it open while its nodes are read
        rng = range_fs.getNode("range").mat()
        if rng is None or rng.shape != (2, sv.shape[1]):
            raise ValueError(f"{scale}: no 2×{sv.shape[1]} 'range' matrix")
        return cls(sv, alpha, df.getNode("rho").real(), root.getNode("kernel").getNode("gamma").real(),
                   rng[0].astype(np.float64), rng[1].astype(np.float64))


def wheel_model() -> tuple[Path, Path]:
    """The LIVE model inside the installed `brisque` wheel (found, not imported)."""
    spec = importlib.util.find_spec("brisque")
    if spec is None or not spec.submodule_search_locations:
        raise ScoringError("the brisque reward's default model ships in the brisque package; install it with "
                           "`pip install 'pixrl[quality]'` or set reward.options.brisque.model")
    root = Path(list(spec.submodule_search_locations)[0]) / "models"
    return root / "svm.txt", root / "normalize.pickle"


@register_reward("brisque")
class Brisque(Reward):
    value_range = (0.0, 1.0)
    requires = ("cv2", "scipy")
    extra = "quality"

    def __init__(self, model: str = "", range: str = ""):  # noqa: A002 (the model's feature range)
        if model and not Path(model).is_file():
            raise ValueError(f"reward brisque: model {model!r} is not a file; leave reward.options.brisque.model empty "
                             f"for the LIVE model in the brisque wheel, or point it at brisque_model_live.yml")
        if model and (not range or not Path(range).is_file()):
            raise ValueError(f"reward brisque: a model needs its feature range; set reward.options.brisque.range "
                             f"(brisque_range_live.yml beside brisque_model_live.yml, or normalize.pickle); "
                             f"{range!r} is not a file")
        self.model_path, self.range_path = model, range
        self.requires = self.requires + (() if model else ("brisque",))  # the default model ships in that wheel
        self.svr = None

    def setup(self, device: str = "cpu") -> None:
        super().setup(device)
        self.optional_import("cv2", "GaussianBlur")
        model, scale = (Path(self.model_path), Path(self.range_path)) if self.model_path else wheel_model()
        try:
            opencv = model.suffix.lower() in (".yml", ".yaml", ".xml")
            self.svr = (SVR.opencv if opencv else SVR.libsvm)(model, scale)
        except Exception as exc:  # file formats raise many types; name the files and the cause
            raise ScoringError(f"reward 'brisque': could not read the model {str(model)!r} with range {str(scale)!r}: "
                               f"{type(exc).__name__}: {exc}") from exc

    def score(self, images, prompts, metadata):
        raw = np.array([self.svr(features(im)) for im in images], np.float32)
        return {self.name: (1 - np.clip(raw, 0, 100) / 100).astype(np.float32), f"{self.name}.raw": raw}
