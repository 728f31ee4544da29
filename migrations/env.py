"""Alembic environment: the schema is built by these migrations everywhere, tests included."""

from alembic import context
from sqlalchemy import Connection

from sdq.models.datasets import tables as dataset_tables  # noqa: F401  (registers them)
from sdq.models.db import make_engine
from sdq.models.jobs.kinds import import_tables
from sdq.models.tables import Base

# The datasets' tables (models/datasets/tables.py) and each kind's own (models/<kind>/
# tables.py) belong to the schema that autogenerate and `alembic check` compare against.
import_tables()


def run_migrations(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        # SQLite cannot ALTER most things; batch mode rebuilds the table instead.
        render_as_batch=connection.dialect.name == "sqlite",
        # One transaction around the whole upgrade on SQLite too, as run_command began it
        # before Alembic did (Alembic's default there is one per migration).
        transactional_ddl=True,
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def main() -> None:
    config = context.config
    connection = config.attributes.get("connection")
    if connection is not None:
        run_migrations(connection)
        return
    engine = make_engine(config.get_main_option("sqlalchemy.url"))
    with engine.connect() as connection:
        run_migrations(connection)


main()
