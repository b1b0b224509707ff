-- The operators' audit trail (`admin::list_audit`), newest first, through its primary key.
--   $1 cursor: ids below it   $2 limit
SELECT id, who, action, target, reason, details, at FROM actix_outbox.admin_audit
WHERE ($1::int8 IS NULL OR id < $1) ORDER BY id DESC LIMIT $2
