package main

import (
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// TestFailoverURLAsDocumented: docs/operations.md's multi-host DATABASE_URL, in both the URL
// form and the key/value form, parses into what the failover relies on: both hosts in order,
// a check that keeps only the node that accepts writes, the connect timeout. The failover
// tests run the key/value form against real nodes; the URL form was never parsed.
func TestFailoverURLAsDocumented(t *testing.T) {
	doc, err := os.ReadFile("../../docs/operations.md")
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^DATABASE_URL='([^']+)'\n# or key/value: (.+)$`).FindSubmatch(doc)
	if m == nil {
		t.Fatal("docs/operations.md shows no multi-host DATABASE_URL with its key/value form")
	}
	for _, conn := range []string{string(m[1]), string(m[2])} {
		cfg, err := pgxpool.ParseConfig(conn)
		if err != nil {
			t.Errorf("%s: %v", conn, err)
			continue
		}
		cc := cfg.ConnConfig
		// The hosts in the order pgx tries them (each may come twice: with TLS and without,
		// sslmode's default "prefer").
		hosts := []string{cc.Host}
		for _, f := range cc.Fallbacks {
			if f.Host != hosts[len(hosts)-1] {
				hosts = append(hosts, f.Host)
			}
		}
		if strings.Join(hosts, ",") != "db1,db2" || cc.Port != 5432 || cc.Database != "ledger" || cc.User != "ledger" ||
			cc.ValidateConnect == nil || cc.ConnectTimeout != 2*time.Second {
			t.Errorf("%s: hosts %v, port %d, database %s, user %s, read-write check %v, connect timeout %v",
				conn, hosts, cc.Port, cc.Database, cc.User, cc.ValidateConnect != nil, cc.ConnectTimeout)
		}
	}
}
