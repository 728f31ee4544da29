"""The deployment's store, as its database records it: `sdq db upgrade` records the store it
made, and every process with a broker (workers, submits, the API) is refused at start where
its own store is another, rather than record outputs where nobody else reads them."""

from sqlalchemy import inspect
from sqlalchemy.orm import Session

from sdq.models.jobs.lifecycle import utcnow
from sdq.models.tables import Deployment

THE_ROW = 1


def record_store(session: Session, store_uri: str) -> None:
    row = session.get(Deployment, THE_ROW)
    if row is None:
        session.add(Deployment(id=THE_ROW, store_uri=store_uri, set_at=utcnow()))
    elif row.store_uri != store_uri:
        row.store_uri, row.set_at = store_uri, utcnow()


def recorded_store(session: Session) -> str | None:
    """The store's URI as last recorded; None before any `sdq db upgrade` recorded one, or
    on a schema from before the record (a worker of a newer release, started before its
    migration ran)."""
    if not inspect(session.connection()).has_table(Deployment.__tablename__):
        return None
    row = session.get(Deployment, THE_ROW)
    return None if row is None else row.store_uri
