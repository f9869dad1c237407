package dbidem

import (
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
)

// TestLockingReadInEveryTranslation: the context of a lock timeout at idem_begin's locking
// read, as servers with English, German, French and Japanese messages write it, is a key wait;
// the unlocked read's, the INSERT's and another function's locking read are not.
func TestLockingReadInEveryTranslation(t *testing.T) {
	const stmt = "SELECT k.state, k.attempt\n     FROM idem.idempotency_keys AS k\n WHERE k.key = p_key\n   FOR UPDATE"
	const plain = "SELECT k.state, k.attempt\n     FROM idem.idempotency_keys AS k\n WHERE k.key = p_key"
	const insert = "INSERT INTO idem.idempotency_keys AS k (key) VALUES (p_key) ON CONFLICT DO NOTHING"
	const fn = "idem.idem_begin(text,text,text,bytea,interval,interval,jsonb,interval) line 404 at SQL statement"
	for _, c := range []struct {
		where string
		want  bool
	}{
		{`SQL statement "` + stmt + "\"\nPL/pgSQL function " + fn, true},
		{"SQL-Anweisung »" + stmt + "«\nPL/pgSQL-Funktion " + fn, true},
		{"instruction SQL « " + stmt + " »\nfonction PL/pgSQL " + fn, true},
		{"SQL文「" + stmt + "」\nPL/pgSQL関数 " + fn, true},
		{`SQL statement "` + plain + "\"\nPL/pgSQL function " + fn, false},
		{`SQL statement "` + insert + "\"\nPL/pgSQL function " + fn, false},
		{`SQL statement "SELECT 1 FROM other AS o FOR UPDATE"` + "\nPL/pgSQL function " + fn, false},
		{`SQL statement "` + stmt + "\"\nPL/pgSQL function idem.idem_step(text) line 9 at SQL statement", false},
		// The INSERT's wait for the row's writer, in French: a space after the comma.
		{"lors de l'insertion de l'enregistrement (0, 3) de l'index dans la relation « idempotency_keys »\ninstruction SQL « " + insert + " »\nfonction PL/pgSQL " + fn, true},
		// And in Korean: the position without parentheses, first on the line.
		{"0,3 튜플 인덱스(해당 릴레이션 \"idempotency_keys\")를 삽입하는 중에 발생\nSQL 구문: \"" + insert + "\"\nPL/pgSQL 함수 \"" + fn + "\"", true},
		{"while inserting index tuple (0,3) in relation \"other\"\nSQL statement \"" + insert + "\"\nPL/pgSQL function " + fn, false},
		{"", false},
	} {
		err := &pgconn.PgError{Code: "55P03", Where: c.where}
		if got := IsKeyWait(err); got != c.want {
			t.Errorf("IsKeyWait of a 55P03 with the context %q: %v, want %v", c.where, got, c.want)
		}
	}
}
