// Preloaded into an API process by api.test.js (NODE_OPTIONS=--import=...):
// what many applications do to get numbers, not strings, for bigint
// columns.  It changes node-pg's parsing for the whole process.
import pg from 'pg';

pg.types.setTypeParser(20, parseInt);
console.log('bigint values are parsed with parseInt');
