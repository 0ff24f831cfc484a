-- floor, replay: primary-key SELECT of a completed record's stored response
\set r random(1, 100000)
SELECT fingerprint, completed_at, expires_at, response FROM floor_record WHERE role_id = 10 AND operation = 'bench.op' AND key = :r;
