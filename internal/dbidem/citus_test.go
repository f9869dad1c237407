package dbidem

import (
	"errors"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
)

// The errors below are the fields a client received, recorded against Citus 13.2.2 (a
// coordinator and two workers, PostgreSQL 15, pgx v5.12.0) and against plain PostgreSQL 15
// with the same SQL API; docs/sql-api.md ("On Citus") lists them.
var (
	plainGuard = &pgconn.PgError{Severity: "ERROR", Code: "23503",
		Message:    `insert or update on table "idempotency_keys" violates foreign key constraint "idempotency_keys_claim_completed_in_its_transaction"`,
		Detail:     `Key (uncompleted)=(t) is not present in table "claim_guard".`,
		SchemaName: "idem", TableName: "idempotency_keys", ConstraintName: GuardConstraint,
		File: "ri_triggers.c", Routine: "ri_ReportViolation"}
	// A claim committed without its completion, its transaction on one worker: one-phase
	// commit, the worker's 23503 only a WARNING before this.
	citusGuardOnePhase = &pgconn.PgError{Severity: "ERROR", Code: "XX000",
		Message: "could not commit transaction for shard 102034 on at least one active node",
		File:    "placement_connection.c", Line: 1004, Routine: "ErrorIfPostCommitFailedShardPlacements"}
	// The same, the transaction on two workers: two-phase commit, the worker's error itself,
	// without schema, table or constraint.
	citusGuardTwoPhase = &pgconn.PgError{Severity: "ERROR", Code: "23503",
		Message: `insert or update on table "idempotency_keys_102017" violates foreign key constraint "idempotency_keys_claim_completed_in_its_transaction_102017"`,
		Detail:  `Key (uncompleted)=(t) is not present in table "claim_guard_102008".`,
		Where:   "while executing command on 127.0.0.1:9702",
		File:    "remote_commands.c", Line: 319, Routine: "ReportResultError"}
	plainPrincipal = &pgconn.PgError{Severity: "ERROR", Code: "23503",
		Message:    `insert or update on table "idempotency_keys" violates foreign key constraint "idempotency_keys_principal_fkey"`,
		Detail:     `Key (principal_id)=(no-such-principal) is not present in table "principals".`,
		Where:      "SQL statement \"INSERT INTO idem.idempotency_keys AS k ...\"\nPL/pgSQL function idem.idem_begin(text,text,text,bytea,interval,interval,jsonb,interval) line 109 at SQL statement",
		SchemaName: "idem", TableName: "idempotency_keys", ConstraintName: "idempotency_keys_principal_fkey",
		File: "ri_triggers.c", Routine: "ri_ReportViolation"}
	citusPrincipal = &pgconn.PgError{Severity: "ERROR", Code: "23503",
		Message: `insert or update on table "idempotency_keys_102039" violates foreign key constraint "idempotency_keys_principal_fkey_102039"`,
		Detail:  `Key (principal_id)=(no-such-principal) is not present in table "principals_102042".`,
		Where: "SQL statement \"INSERT INTO idem.idempotency_keys AS k ...\"\nPL/pgSQL function idem.idem_begin(text,text,text,bytea,interval,interval,jsonb,interval) line 109 at SQL statement\n" +
			"while executing command on 127.0.0.1:9702",
		File: "remote_commands.c", Line: 319, Routine: "ReportResultError"}
	citusLockTimeout = &pgconn.PgError{Severity: "ERROR", Code: "55P03", Message: "canceling statement due to lock timeout",
		Where: "while inserting index tuple (172,27) in relation \"idempotency_keys_102034\"\nSQL statement \"INSERT INTO idem.idempotency_keys AS k ...\"\n" +
			"PL/pgSQL function idem.idem_begin(text,text,text,bytea,interval,interval,jsonb,interval) line 109 at SQL statement\nwhile executing command on 127.0.0.1:9701",
		File: "remote_commands.c", Line: 319, Routine: "ReportResultError"}
	citusClaimLost = &pgconn.PgError{Severity: "ERROR", Code: "55000",
		Message: "idem_complete: no claim in progress for this key with attempt 281474976756499",
		Where:   "PL/pgSQL function idem.idem_complete(text,text,bigint,integer,jsonb,bytea,text,text) line 52 at RAISE\nwhile executing command on 127.0.0.1:9701",
		Routine: "ReportResultError"}
	// Another application's foreign key failing at a worker's COMMIT, not on the key table.
	citusOtherViolation = &pgconn.PgError{Severity: "ERROR", Code: "23503",
		Message: `insert or update on table "transfers_102100" violates foreign key constraint "transfers_to_fkey_102100"`,
		Where:   "while executing command on 127.0.0.1:9702", Routine: "ReportResultError"}
)

// TestClassifyCitusErrors: the driver gives the same sentinel for an error whether it came from
// one PostgreSQL or through a Citus coordinator.
func TestClassifyCitusErrors(t *testing.T) {
	for _, c := range []struct {
		name string
		err  *pgconn.PgError
		want error
	}{
		{"plain guard", plainGuard, ErrClaimNotCompleted},
		{"Citus guard, two-phase", citusGuardTwoPhase, ErrClaimNotCompleted},
		{"plain unknown principal", plainPrincipal, ErrUnknownPrincipal},
		{"Citus unknown principal", citusPrincipal, ErrUnknownPrincipal},
		{"Citus lock timeout", citusLockTimeout, ErrInProgress},
		{"Citus claim lost", citusClaimLost, ErrClaimLost},
		{"Citus, another table's foreign key", citusOtherViolation, nil},
	} {
		got := classify(c.err)
		if c.want == nil {
			if errors.Is(got, ErrClaimNotCompleted) || errors.Is(got, ErrUnknownPrincipal) {
				t.Errorf("%s: classified as %v", c.name, got)
			}
			continue
		}
		if !errors.Is(got, c.want) {
			t.Errorf("%s: %v, want %v", c.name, got, c.want)
		}
	}
	if !IsKeyWait(citusLockTimeout) {
		t.Error("a lock timeout on a shard of the key table is not recognised as a wait on the key")
	}

	// The one-phase form is the guard only for a transaction that holds an uncompleted
	// transactional claim (which cannot commit); otherwise the worker refused its COMMIT or
	// its connection failed while it committed: the outcome is unknown (D175).
	if err := uncompletedCommitError(citusGuardOnePhase, true, true); !errors.Is(err, ErrClaimNotCompleted) || errors.Is(err, ErrCommitUnknown) {
		t.Errorf("Citus guard, one-phase, claim uncompleted: %v", err)
	}
	if err := uncompletedCommitError(citusGuardOnePhase, true, false); errors.Is(err, ErrClaimNotCompleted) || !errors.Is(err, ErrCommitUnknown) {
		t.Errorf("a Citus commit failure without an uncompleted claim: %v, want ErrCommitUnknown", err)
	}
	if err := commitError(citusGuardOnePhase, true); !errors.Is(err, ErrCommitUnknown) {
		t.Errorf("a Citus commit failure after a completion: %v, want ErrCommitUnknown", err)
	}
}
