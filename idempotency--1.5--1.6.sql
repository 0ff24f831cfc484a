/* idempotency--1.5--1.6.sql: ALTER EXTENSION idempotency UPDATE TO '1.6' */

\echo Use "ALTER EXTENSION idempotency UPDATE TO '1.6'" to load this file. \quit
