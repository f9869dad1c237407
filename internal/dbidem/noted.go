package dbidem

import (
	"context"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Watching the work's statements: every result a statement of a Tx (nested ones and
// batches included) gives is noted, so that a serialization failure or a deadlock makes
// RunTx run the unit again.

// nestedTx is a savepoint of a Tx: its statements are watched too.
type nestedTx struct {
	pgx.Tx
	owner *Tx
}

// Every method of a savepoint first asks its owner whether the transaction may still be used
// (Tx.ended): a savepoint kept past a COMMIT or ROLLBACK sent as SQL, or past the unit of work
// (its connection another's now, perhaps in another request's transaction), sends nothing.

func (n *nestedTx) Begin(ctx context.Context) (pgx.Tx, error) {
	if err := n.owner.ended(); err != nil {
		return nil, err
	}
	nested, err := n.Tx.Begin(ctx)
	n.owner.note(err)
	if err != nil {
		return nil, err
	}
	return &nestedTx{Tx: nested, owner: n.owner}, nil
}

func (n *nestedTx) Commit(ctx context.Context) error {
	if err := n.owner.ended(); err != nil {
		return err
	}
	err := n.Tx.Commit(ctx)
	n.owner.note(err)
	return err
}

func (n *nestedTx) Rollback(ctx context.Context) error {
	if err := n.owner.ended(); err != nil {
		return err
	}
	return n.Tx.Rollback(ctx)
}

func (n *nestedTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	if err := n.owner.ended(); err != nil {
		return pgconn.CommandTag{}, err
	}
	return execNoted(ctx, n.Tx, n.owner, sql, args)
}

func (n *nestedTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	if err := n.owner.ended(); err != nil {
		return nil, err
	}
	return queryNoted(ctx, n.Tx, n.owner, sql, args)
}

func (n *nestedTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	rows, err := n.Query(ctx, sql, args...)
	return &notedRow{rows: rows, err: err}
}

func (n *nestedTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	if err := n.owner.ended(); err != nil {
		return pgx.FailedBatchResults(b, err)
	}
	return &notedBatch{BatchResults: n.Tx.SendBatch(ctx, b), owner: n.owner}
}

func (n *nestedTx) CopyFrom(ctx context.Context, table pgx.Identifier, columns []string, src pgx.CopyFromSource) (int64, error) {
	if err := n.owner.ended(); err != nil {
		return 0, err
	}
	c, err := n.Tx.CopyFrom(ctx, table, columns, src)
	n.owner.note(err)
	return c, err
}

func (n *nestedTx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	if err := n.owner.ended(); err != nil {
		return nil, err
	}
	return n.Tx.Prepare(ctx, name, sql)
}

// LargeObjects fails every call once the transaction may not be used.
func (n *nestedTx) LargeObjects() pgx.LargeObjects {
	if err := n.owner.ended(); err != nil {
		b := &pgx.Batch{}
		b.BeginTx(pgx.TxOptions{})
		return pgx.FailedBatchResults(b, err).Tx().LargeObjects()
	}
	return n.Tx.LargeObjects()
}

// Conn is nil once the unit of work is over, as the owner's is.
func (n *nestedTx) Conn() *pgx.Conn {
	if n.owner.over.Load() {
		return nil
	}
	return n.Tx.Conn()
}

func execNoted(ctx context.Context, q pgx.Tx, owner *Tx, sql string, args []any) (pgconn.CommandTag, error) {
	tag, err := q.Exec(ctx, sql, args...)
	owner.note(err)
	if err == nil {
		err = owner.ended() // this statement ended the transaction
	}
	return tag, err
}

func queryNoted(ctx context.Context, q pgx.Tx, owner *Tx, sql string, args []any) (pgx.Rows, error) {
	rows, err := q.Query(ctx, sql, args...)
	owner.note(err)
	if err != nil {
		return rows, err
	}
	return &notedRows{Rows: rows, owner: owner}, nil
}

// notedRows notes the error that ends the rows.
type notedRows struct {
	pgx.Rows
	owner *Tx
}

func (r *notedRows) Err() error {
	err := r.Rows.Err()
	r.owner.note(err)
	return err
}

// Conn is nil once the unit of work is over, as the Tx's is: rows kept past it would hand out
// a connection of the pool, perhaps another request's by then.
func (r *notedRows) Conn() *pgx.Conn {
	if r.owner.over.Load() {
		return nil
	}
	return r.Rows.Conn()
}

// Close closes the rows and notes the error that ended them: a handler that reads its rows
// to the end and never asks Err still has its serialization failure rerun.
func (r *notedRows) Close() {
	r.Rows.Close()
	r.owner.note(r.Rows.Err())
}

// notedRow behaves as pgx's Row: the first row, pgx.ErrNoRows when there is none.
type notedRow struct {
	rows pgx.Rows
	err  error
}

func (r *notedRow) Scan(dest ...any) error {
	if r.err != nil {
		return r.err
	}
	defer r.rows.Close()
	if !r.rows.Next() {
		if err := r.rows.Err(); err != nil {
			return err
		}
		return pgx.ErrNoRows
	}
	if err := r.rows.Scan(dest...); err != nil {
		return err
	}
	r.rows.Close()
	return r.rows.Err()
}

// notedBatch notes retryable errors from a batch's results.
type notedBatch struct {
	pgx.BatchResults
	owner *Tx
}

func (b *notedBatch) Exec() (pgconn.CommandTag, error) {
	tag, err := b.BatchResults.Exec()
	b.owner.note(err)
	return tag, err
}

func (b *notedBatch) Query() (pgx.Rows, error) {
	rows, err := b.BatchResults.Query()
	b.owner.note(err)
	if err != nil {
		return rows, err
	}
	return &notedRows{Rows: rows, owner: b.owner}, nil
}

func (b *notedBatch) QueryRow() pgx.Row {
	return &notedBatchRow{Row: b.BatchResults.QueryRow(), owner: b.owner}
}

func (b *notedBatch) Close() error {
	err := b.BatchResults.Close()
	b.owner.note(err)
	if err == nil {
		err = b.owner.ended() // a statement of the batch ended the transaction
	}
	return err
}

type notedBatchRow struct {
	pgx.Row
	owner *Tx
}

func (r *notedBatchRow) Scan(dest ...any) error {
	err := r.Row.Scan(dest...)
	r.owner.note(err)
	return err
}
