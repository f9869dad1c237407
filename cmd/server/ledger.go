package main

import (
	"errors"
	"fmt"
	"math"
	"net/http"
	"strconv"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/go-json-experiment/json/jsontext"
	"github.com/gorilla/mux"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/idem/idemriver"
)

// amountKind is what amount found in a JSON number.
type amountKind int

const (
	amountOK       amountKind = iota
	amountInvalid             // not a positive integer: a fraction, zero, a negative
	amountTooLarge            // a positive integer past the largest balance, 2^63 - 1
)

// amount reads a positive integer amount in minor units from a JSON number in its canonical
// form, which is what DecodeJSON decodes (1e2 and 100.0 are 100; an integer of 1e21 or more is
// written with an exponent, 1e+21). An integer past the largest balance is told apart from a
// number that is no amount at all: a deposit of it is balance_limit, a transfer of it
// insufficient_funds.
func amount(v jsontext.Value) (int64, amountKind) {
	if v.Kind() != '0' {
		return 0, amountInvalid
	}
	s := string(v)
	n, err := strconv.ParseInt(s, 10, 64)
	switch {
	case err == nil && n > 0:
		return n, amountOK
	case err == nil:
		return 0, amountInvalid
	case errors.Is(err, strconv.ErrRange) && strings.Trim(s, "0123456789") == "":
		return 0, amountTooLarge // digits only: an integer (a fraction has its point, below 1e21)
	}
	// 1e+21 and above: an integer when the exponent covers the digits after the point.
	mantissa, exp, ok := strings.Cut(s, "e+")
	if !ok || strings.HasPrefix(mantissa, "-") {
		return 0, amountInvalid
	}
	_, fraction, _ := strings.Cut(mantissa, ".")
	if e, err := strconv.Atoi(exp); err != nil || len(fraction) > e {
		return 0, amountInvalid
	}
	return 0, amountTooLarge
}

// invalidAmount answers an amount that is not a positive integer of minor units.
func invalidAmount(w http.ResponseWriter, r *http.Request) {
	invalid(w, r, fmt.Sprintf("amount must be a positive integer in minor units, at most %d", int64(math.MaxInt64)))
}

// bodyAccountID reads an account id in a body as an amount is read: a positive integer of 64 bits
// (1.0 and 1e2 are integers), else no id, 422 validation_failed, whether it is 0, negative,
// a fraction or past the range (a fraction was 400 malformed_body, a negative 422: D263).
func bodyAccountID(v jsontext.Value) (int64, bool) {
	n, kind := amount(v)
	return n, kind == amountOK
}

// isNumber tells a JSON number from the other kinds (a string amount is a malformed body).
func isNumber(v *jsontext.Value) bool { return v != nil && v.Kind() == '0' }

// overflow tells whether err is PostgreSQL's numeric_value_out_of_range (a balance past the
// bigint range).
func overflow(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "22003"
}

func balanceLimit(w http.ResponseWriter, r *http.Request) {
	problem(w, r, http.StatusUnprocessableEntity, "balance_limit",
		fmt.Sprintf("the operation would take a balance past %d minor units", int64(math.MaxInt64)))
}

type account struct {
	ID        int64     `json:"id"`
	Name      string    `json:"name"`
	Currency  string    `json:"currency"`
	Balance   int64     `json:"balance"`
	Version   int64     `json:"version"`
	CreatedAt time.Time `json:"created_at"`
}

// etag is derived from the account's version, so a replayed ETag and a fresh GET of the
// same version agree.
func (a account) etag() string { return fmt.Sprintf(`"%d"`, a.Version) }

// matches tells whether an If-None-Match header value matches etag (RFC 9110, 13.1.2): "*",
// or a list of entity tags of which one is etag under the weak comparison (W/ ignored).
func matches(ifNoneMatch, etag string) bool {
	for _, tag := range strings.Split(ifNoneMatch, ",") {
		tag = strings.TrimSpace(tag)
		if tag == "*" || strings.TrimPrefix(tag, "W/") == etag {
			return true
		}
	}
	return false
}

// accountVersion is the account's version as a query reads it (D162). It is a bigint revision
// from ledger migration 007 on; the integer column version, which ran out after 2^31 - 1
// changes, goes on beside it, wrapped into 1 to 2^30 (f(r) = (r - 1) % 2^30 + 1), so that the
// previous release's "version + 1" has room for 2^30 more changes of the account and never
// overflows while it serves an upgrade. What the previous release adds to version alone is
// still counted: the version is the revision plus what version has gained over f(revision),
// or version where no change of this release has reached the account yet. nextRevision is what
// a change of this release sets.
const (
	accountVersion = `coalesce(revision + version - ((revision - 1) % 1073741824 + 1), version)`
	nextRevision   = `revision = ` + accountVersion + ` + 1, version = ` + accountVersion + ` % 1073741824 + 1`
)

func (a account) send(w http.ResponseWriter, status int) {
	w.Header().Set("ETag", a.etag())
	if status == http.StatusCreated {
		w.Header().Set("Location", fmt.Sprintf("/v1/accounts/%d", a.ID))
	}
	writeJSON(w, status, a)
}

// validName: 1 to 100 characters, no control characters (U+0000 included).
func validName(n string) bool {
	if c := utf8.RuneCountInString(n); c < 1 || c > 100 || !utf8.ValidString(n) {
		return false
	}
	for _, r := range n {
		if unicode.IsControl(r) {
			return false
		}
	}
	return true
}

func validCurrency(c string) bool {
	if len(c) != 3 {
		return false
	}
	for i := 0; i < 3; i++ {
		if c[i] < 'A' || c[i] > 'Z' {
			return false
		}
	}
	return true
}

func (s *ledger) createAccount(w http.ResponseWriter, r *http.Request) {
	var in struct {
		Name     *string `json:"name"`
		Currency *string `json:"currency"`
	}
	if !idem.DecodeJSON(w, r, &in) {
		return
	}
	switch {
	case in.Name == nil || in.Currency == nil:
		missing(w, r, "name and currency")
		return
	case !validName(*in.Name):
		invalid(w, r, "name must be 1 to 100 characters, none of them a control character")
		return
	case !validCurrency(*in.Currency):
		invalid(w, r, "currency must be an ISO 4217 code such as EUR")
		return
	}
	principal, _ := principalOf(r.Context())
	var a account
	err := idem.TxFrom(r.Context()).QueryRow(r.Context(), `INSERT INTO ledger.accounts (principal_id, name, currency)
		VALUES ($1, $2, $3) RETURNING id, name, currency, balance, `+accountVersion+`, created_at`, principal, *in.Name, *in.Currency).
		Scan(&a.ID, &a.Name, &a.Currency, &a.Balance, &a.Version, &a.CreatedAt)
	if err != nil {
		s.serverError(w, r, err)
		return
	}
	a.send(w, http.StatusCreated)
}

// missing answers a body that lacks a required member: it is not the documented object.
func missing(w http.ResponseWriter, r *http.Request, members string) {
	idem.Refuse(w, r, idem.CodeMalformedBody, "the body must have the members "+members)
}

// pathID is the id in the path as its decimal digits, written as the API writes ids: a sign,
// a leading zero or an escaped digit ("+2", "002", "%32") names no account (404), so that one
// account has one path, and a retry through a proxy that rewrites the path is not another
// request with its key (its fingerprint hashes the path as sent).
func pathID(r *http.Request, name string) (int64, bool) {
	v := mux.Vars(r)[name]
	id, err := strconv.ParseInt(v, 10, 64)
	return id, err == nil && id > 0 && r.URL.RawPath == "" && strconv.FormatInt(id, 10) == v
}

func (s *ledger) getAccount(w http.ResponseWriter, r *http.Request) {
	principal, _ := principalOf(r.Context())
	id, ok := pathID(r, "id")
	var a account
	err := pgx.ErrNoRows
	if ok {
		err = s.pool.QueryRow(r.Context(), `SELECT id, name, currency, balance, `+accountVersion+`, created_at
			FROM ledger.accounts WHERE id = $1 AND principal_id = $2`, id, principal).
			Scan(&a.ID, &a.Name, &a.Currency, &a.Balance, &a.Version, &a.CreatedAt)
	}
	if errors.Is(err, pgx.ErrNoRows) {
		accountNotFound(w, r)
		return
	}
	if err != nil {
		s.serverError(w, r, err)
		return
	}
	// Several field lines of one field are one comma-separated list (RFC 9110, 5.3).
	if inm := strings.Join(r.Header.Values("If-None-Match"), ","); inm != "" && matches(inm, a.etag()) {
		w.Header().Set("ETag", a.etag())
		w.WriteHeader(http.StatusNotModified)
		return
	}
	a.send(w, http.StatusOK)
}

type deposit struct {
	ID        int64     `json:"id"`
	AccountID int64     `json:"account_id"`
	Amount    int64     `json:"amount"`
	Balance   int64     `json:"balance,omitempty"`
	CreatedAt time.Time `json:"created_at"`
}

func (s *ledger) createDeposit(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	var in struct {
		Amount *jsontext.Value `json:"amount"`
	}
	if !idem.DecodeJSON(w, r, &in) {
		return
	}
	if !isNumber(in.Amount) {
		missing(w, r, "amount (a number)")
		return
	}
	amt, kind := amount(*in.Amount)
	if kind == amountInvalid {
		invalidAmount(w, r)
		return
	}
	id, ok := pathID(r, "id")
	principal, _ := principalOf(ctx)
	tx := idem.TxFrom(ctx)
	if kind == amountTooLarge {
		// No balance could take it, but a balance there must be: an account that is missing or
		// another principal's is account_not_found, as for any amount.
		var there bool
		if ok {
			if err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT FROM ledger.accounts WHERE id = $1 AND principal_id = $2)`,
				id, principal).Scan(&there); err != nil {
				s.serverError(w, r, err)
				return
			}
		}
		if !there {
			accountNotFound(w, r)
			return
		}
		balanceLimit(w, r)
		return
	}
	var out deposit
	err := pgx.ErrNoRows
	if ok {
		err = tx.QueryRow(ctx, `UPDATE ledger.accounts SET balance = balance + $1, `+nextRevision+`
			WHERE id = $2 AND principal_id = $3 RETURNING balance`, amt, id, principal).Scan(&out.Balance)
	}
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		accountNotFound(w, r)
		return
	case overflow(err):
		balanceLimit(w, r)
		return
	case err != nil:
		s.serverError(w, r, err)
		return
	}
	err = tx.QueryRow(ctx, `INSERT INTO ledger.deposits (account_id, amount, idempotency_key) VALUES ($1, $2, $3)
		RETURNING id, account_id, amount, created_at`, id, amt, nullKey(r)).Scan(&out.ID, &out.AccountID, &out.Amount, &out.CreatedAt)
	if err != nil {
		s.serverError(w, r, err)
		return
	}
	w.Header().Set("Location", fmt.Sprintf("/v1/accounts/%d/deposits/%d", id, out.ID))
	writeJSON(w, http.StatusCreated, out)
}

func (s *ledger) getDeposit(w http.ResponseWriter, r *http.Request) {
	principal, _ := principalOf(r.Context())
	id, ok1 := pathID(r, "id")
	depID, ok2 := pathID(r, "deposit_id")
	var d deposit
	err := pgx.ErrNoRows
	if ok1 && ok2 {
		err = s.pool.QueryRow(r.Context(), `SELECT d.id, d.account_id, d.amount, d.created_at
			FROM ledger.deposits d JOIN ledger.accounts a ON a.id = d.account_id
			WHERE d.id = $1 AND d.account_id = $2 AND a.principal_id = $3`, depID, id, principal).
			Scan(&d.ID, &d.AccountID, &d.Amount, &d.CreatedAt)
	}
	if errors.Is(err, pgx.ErrNoRows) {
		problem(w, r, http.StatusNotFound, "deposit_not_found", "no such deposit")
		return
	}
	if err != nil {
		s.serverError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, d)
}

// nullKey records which key a request carried, for audits (and the money-invariant test):
// the key as the middleware parsed it, so the audit column and the key row agree ("k1" sent
// as a quoted sf-string is k1 in both).
func nullKey(r *http.Request) *string {
	if c, ok := idem.ClaimOf(r.Context()); ok {
		return &c.Key
	}
	return nil
}

type transfer struct {
	ID        int64     `json:"id"`
	From      int64     `json:"from"`
	To        int64     `json:"to"`
	Amount    int64     `json:"amount"`
	CreatedAt time.Time `json:"created_at"`
}

// lockTransferAccounts locks a transfer's two accounts in id order, so that two opposite
// transfers cannot deadlock. FOR NO KEY UPDATE, not FOR UPDATE: a transfer changes no key,
// and the weaker lock lets the foreign-key checks of rows that reference the accounts (a
// payout's record, a deposit's) pass without waiting. With FOR UPDATE such a check, which
// also locks the account's newer versions, could wait for a transfer that waited for it: a
// deadlock, and a 500 for a payout whose record is written outside the request's
// transaction (D185).
const lockTransferAccounts = `SELECT id, currency, balance FROM ledger.accounts
	WHERE id IN ($1, $2) AND principal_id = $3 ORDER BY id FOR NO KEY UPDATE`

func (s *ledger) createTransfer(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	var in struct {
		From   *jsontext.Value `json:"from"`
		To     *jsontext.Value `json:"to"`
		Amount *jsontext.Value `json:"amount"`
	}
	if !idem.DecodeJSON(w, r, &in) {
		return
	}
	if !isNumber(in.From) || !isNumber(in.To) || !isNumber(in.Amount) {
		missing(w, r, "from, to and amount (numbers)")
		return
	}
	amt, kind := amount(*in.Amount)
	from, fromOK := bodyAccountID(*in.From)
	to, toOK := bodyAccountID(*in.To)
	switch {
	case kind == amountInvalid:
		invalidAmount(w, r)
		return
	case !fromOK || !toOK:
		invalid(w, r, "from and to must be account ids")
		return
	case from == to:
		invalid(w, r, "from and to must be different accounts")
		return
	}
	principal, _ := principalOf(ctx)
	tx := idem.TxFrom(ctx)
	rows, err := tx.Query(ctx, lockTransferAccounts, from, to, principal)
	if err != nil {
		s.serverError(w, r, err)
		return
	}
	type acc struct {
		currency string
		balance  int64
	}
	found := map[int64]acc{}
	for rows.Next() {
		var id int64
		var a acc
		if err := rows.Scan(&id, &a.currency, &a.balance); err != nil {
			rows.Close()
			s.serverError(w, r, err)
			return
		}
		found[id] = a
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		s.serverError(w, r, err)
		return
	}
	src, okFrom := found[from]
	dst, okTo := found[to]
	switch {
	case !okFrom || !okTo:
		accountNotFound(w, r)
		return
	case src.currency != dst.currency:
		problem(w, r, http.StatusUnprocessableEntity, "currency_mismatch", "both accounts must hold the same currency")
		return
	case src.balance < amt || kind == amountTooLarge:
		problem(w, r, http.StatusUnprocessableEntity, "insufficient_funds", "the source account's balance is lower than the amount")
		return
	case dst.balance > math.MaxInt64-amt:
		balanceLimit(w, r)
		return
	}
	batch := &pgx.Batch{}
	batch.Queue(`UPDATE ledger.accounts SET balance = balance - $1, `+nextRevision+` WHERE id = $2`, amt, from)
	batch.Queue(`UPDATE ledger.accounts SET balance = balance + $1, `+nextRevision+` WHERE id = $2`, amt, to)
	var out transfer
	batch.Queue(`INSERT INTO ledger.transfers (principal_id, from_id, to_id, amount, idempotency_key) VALUES ($1, $2, $3, $4, $5)
		RETURNING id, from_id, to_id, amount, created_at`, principal, from, to, amt, nullKey(r)).
		QueryRow(func(row pgx.Row) error {
			return row.Scan(&out.ID, &out.From, &out.To, &out.Amount, &out.CreatedAt)
		})
	if err := tx.SendBatch(ctx, batch).Close(); err != nil {
		s.serverError(w, r, err)
		return
	}
	if s.receipts != nil {
		// The receipt's job commits with the transfer and its key (receipts.go).
		if _, err := idemriver.Insert(ctx, s.receipts, receiptArgs{Principal: principal, Transfer: out.ID, From: out.From,
			To: out.To, Amount: out.Amount, CreatedAt: out.CreatedAt}, nil); err != nil {
			s.serverError(w, r, err)
			return
		}
	}
	w.Header().Set("Location", fmt.Sprintf("/v1/transfers/%d", out.ID))
	writeJSON(w, http.StatusCreated, out)
}

func (s *ledger) getTransfer(w http.ResponseWriter, r *http.Request) {
	principal, _ := principalOf(r.Context())
	id, ok := pathID(r, "id")
	var t transfer
	err := pgx.ErrNoRows
	if ok {
		err = s.pool.QueryRow(r.Context(), `SELECT id, from_id, to_id, amount, created_at FROM ledger.transfers
			WHERE id = $1 AND principal_id = $2`, id, principal).Scan(&t.ID, &t.From, &t.To, &t.Amount, &t.CreatedAt)
	}
	if errors.Is(err, pgx.ErrNoRows) {
		problem(w, r, http.StatusNotFound, "transfer_not_found", "no such transfer")
		return
	}
	if err != nil {
		s.serverError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, t)
}

func (s *ledger) createToken(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	var in struct {
		Name *string `json:"name"`
	}
	if !idem.DecodeJSON(w, r, &in) {
		return
	}
	if in.Name == nil {
		missing(w, r, "name")
		return
	}
	if !validName(*in.Name) {
		invalid(w, r, "name must be 1 to 100 characters, none of them a control character")
		return
	}
	principal, _ := principalOf(ctx)
	token, sum := newToken()
	var id int64
	if err := idem.TxFrom(ctx).QueryRow(ctx, `INSERT INTO ledger.api_tokens (principal_id, name, token_sha256)
		VALUES ($1, $2, $3) RETURNING id`, principal, *in.Name, sum).Scan(&id); err != nil {
		s.serverError(w, r, err)
		return
	}
	idem.MarkOneTimeSecret(ctx) // the token is shown once; a repeat gets 409 one_time_secret
	idem.SetResourceID(ctx, strconv.FormatInt(id, 10))
	writeJSON(w, http.StatusCreated, map[string]any{"id": id, "token": token})
}
