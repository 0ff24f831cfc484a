/* idempotency--1.4--1.5.sql: ALTER EXTENSION idempotency UPDATE TO '1.5' */

\echo Use "ALTER EXTENSION idempotency UPDATE TO '1.5'" to load this file. \quit
