"""The face/pose worker: run by the interpreter of the environment `pixrl setup-mediapipe` makes
(mediapipe 0.10.21 pins numpy < 2 and protobuf < 5, which pixrl's environment cannot hold), as a
file — it imports numpy and mediapipe only, never pixrl.

Protocol on stdin/stdout, each message a 4-byte big-endian length and its bytes: the worker first
sends {"ready": mediapipe version} (or {"error": …} and exits); then each request is an .npz with
`images` (uint8 [B, H, W, 3]) and `request` (JSON: {"task": "face"|"pose", options}) and each reply
is JSON: {"results": [per image]} or {"error": message}.
- face (mediapipe's BlazeFace, `model_selection` 0 short range ≤ 2 m, 1 full range ≤ 5 m):
  per image a list of [score, xmin, ymin, width, height] (relative box) above `min_confidence`;
- pose (BlazePose full, the only pose model the wheel ships): per image null (no person) or the
  33 landmarks' visibilities.
"""

import io
import json
import struct
import sys


def _send(out, obj) -> None:
    data = json.dumps(obj).encode()
    out.write(struct.pack(">I", len(data)) + data)
    out.flush()


def _receive(inp):
    head = inp.read(4)
    if len(head) < 4:
        return None
    (n,) = struct.unpack(">I", head)
    return inp.read(n)


def main() -> None:
    out, inp = sys.stdout.buffer, sys.stdin.buffer
    sys.stdout = sys.stderr  # anything a library prints must not corrupt the protocol
    try:
        import numpy as np
        import mediapipe
        from mediapipe.python.solutions import face_detection, pose
    except Exception as exc:  # the wrong interpreter, or a broken environment
        _send(out, {"error": f"{type(exc).__name__}: {exc}"})
        return
    _send(out, {"ready": mediapipe.__version__})
    solutions = {}

    def solution(task, opts):
        key = (task, json.dumps(opts, sort_keys=True))
        if key not in solutions:
            if task == "face":
                solutions[key] = face_detection.FaceDetection(model_selection=int(opts.get("model_selection", 0)),
                                                              min_detection_confidence=float(opts["min_confidence"]))
            else:
                solutions[key] = pose.Pose(static_image_mode=True, model_complexity=1,
                                           min_detection_confidence=float(opts["min_confidence"]))
        return solutions[key]

    while True:
        body = _receive(inp)
        if body is None:
            return
        try:
            data = np.load(io.BytesIO(body), allow_pickle=False)
            req = json.loads(str(data["request"]))
            task, images = req.pop("task"), data["images"]
            if task not in ("face", "pose"):
                raise ValueError(f"unknown task {task!r}")
            sol, results = solution(task, req), []
            for img in images:
                r = sol.process(np.ascontiguousarray(img))
                if task == "face":
                    results.append([[float(d.score[0]), d.location_data.relative_bounding_box.xmin,
                                     d.location_data.relative_bounding_box.ymin,
                                     d.location_data.relative_bounding_box.width,
                                     d.location_data.relative_bounding_box.height]
                                    for d in (r.detections or [])])
                else:
                    lm = r.pose_landmarks
                    results.append(None if lm is None else [float(p.visibility) for p in lm.landmark])
            _send(out, {"results": results})
        except Exception as exc:  # a bad request: answer it, keep serving
            _send(out, {"error": f"{type(exc).__name__}: {exc}"})


if __name__ == "__main__":
    main()
