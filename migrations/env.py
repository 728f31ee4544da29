"""Alembic environment: the schema is built by these migrations everywhere, tests included."""

import importlib
import pkgutil

from alembic import context
from sqlalchemy import Connection

from sdq.models import tables
from sdq.models.db import make_engine
from sdq.models.tables import Base

# Each kind's tables live in a module of their own beside the generic ones; all of them
# belong to the schema that autogenerate and `alembic check` compare against.
for module in pkgutil.iter_modules(tables.__path__):
    importlib.import_module(f"{tables.__name__}.{module.name}")


def run_migrations(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        # SQLite cannot ALTER most things; batch mode rebuilds the table instead.
        render_as_batch=connection.dialect.name == "sqlite",
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
