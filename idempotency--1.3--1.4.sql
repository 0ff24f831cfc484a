/* idempotency--1.3--1.4.sql: version 1.4 */

\echo Use "ALTER EXTENSION idempotency UPDATE TO '1.4'" to load this file. \quit
