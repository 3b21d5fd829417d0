-- Runs once, when the Postgres volume is first created (docker-entrypoint-initdb.d).
-- POSTGRES_DB already created the `mlflow` database; Prefect gets its own.
CREATE DATABASE prefect;
