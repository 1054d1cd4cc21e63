"""Calibrations in the store (tables `calibrations`, `calibration_points`, migration 0003): what
`canvasq calibrate` saves and what the worker and `canvasq config` read for `--decoder auto`.
The records themselves (`Calibration`, `Point`, `model_identity`) are `canvasq.decoders.calibration`'s:
the decoders know nothing about SQL."""

from __future__ import annotations

from sqlalchemy import select

from canvasq.core.tables import CalibrationPoint, CalibrationRun
from canvasq.decoders.calibration import Calibration, Point, model_identity


def save(store, cal: Calibration) -> int:
    """Store a calibration and its points; returns its id."""
    with store.Session() as s, s.begin():
        run = CalibrationRun(
            model_path=cal.model_path,
            fingerprint=cal.fingerprint,
            device=cal.device,
            hardware=cal.hardware[:200] or None,
            commit=cal.commit[:64] or None,
            batch_size=cal.batch_size,
            n=cal.n,
            seeds=list(cal.seeds),
            max_tokens=cal.max_tokens,
        )
        s.add(run)
        s.flush()
        for p in cal.points:
            s.add(
                CalibrationPoint(
                    calibration_id=run.id,
                    family=p.family,
                    task=p.task,
                    decoder=p.decoder,
                    knobs=dict(p.knobs),
                    label=p.label[:200],
                    n=p.n,
                    accuracy=p.accuracy,
                    tok_s=p.tok_s,
                    fwd_per_req=p.fwd_per_req,
                    tau=p.tau,
                    g_over_tau=p.g_over_tau,
                    frontier=p.frontier,
                    reference=p.reference,
                )
            )
        return run.id


def load(store, model_path: str, fingerprint: str) -> Calibration | None:
    """The newest calibration of the model with this identity, or None."""
    with store.Session() as s:
        run = s.scalars(
            select(CalibrationRun)
            .where(CalibrationRun.fingerprint == fingerprint, CalibrationRun.model_path == model_path)
            .order_by(CalibrationRun.created_at.desc(), CalibrationRun.id.desc())
            .limit(1)
        ).first()
        if run is None:
            return None
        rows = s.scalars(
            select(CalibrationPoint)
            .where(CalibrationPoint.calibration_id == run.id)
            .order_by(CalibrationPoint.id)
        ).all()
        points = tuple(
            Point(
                family=r.family,
                task=r.task,
                decoder=r.decoder,
                knobs=dict(r.knobs or {}),
                n=r.n,
                accuracy=r.accuracy,
                tok_s=r.tok_s,
                fwd_per_req=r.fwd_per_req,
                tau=r.tau,
                g_over_tau=r.g_over_tau,
                frontier=bool(r.frontier),
                reference=bool(r.reference),
            )
            for r in rows
        )
        return Calibration(
            model_path=run.model_path,
            fingerprint=run.fingerprint,
            device=run.device,
            batch_size=run.batch_size,
            n=run.n,
            seeds=tuple(run.seeds or ()),
            max_tokens=run.max_tokens,
            points=points,
            hardware=run.hardware or "",
            commit=run.commit or "",
            created_at=run.created_at.strftime("%Y-%m-%d %H:%M UTC"),
            id=run.id,
        )


def load_for_model(store, spec: str) -> Calibration | None:
    """The newest calibration of the model `spec` names (its current weights), or None."""
    path, fp = model_identity(spec)
    return load(store, path, fp)
