// Command sqllint runs plpgsql_check over every PL/pgSQL function of schema idem, installed
// into a throwaway database the same way `server migrate` installs it, and exits 1 on any
// finding (errors, warnings, performance and security warnings). `make lint` runs it.
//
// It uses TEST_DATABASE_URL when set (the server needs the plpgsql_check extension), else a
// private cluster from the local initdb/pg_ctl in a temporary directory.
package main

import (
	"context"
	"fmt"
	"os"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/internal/pgcluster"
	idemsql "github.com/pgidem/pgidem/sql"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "sqllint:", err)
		os.Exit(1)
	}
}

func run() error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	url := os.Getenv("TEST_DATABASE_URL")
	if url == "" {
		c, stop, err := pgcluster.StartTemp(ctx, "idem-sqllint-", map[string]string{"fsync": "off"})
		if err != nil {
			return err
		}
		defer stop()
		url = c.ConnString("postgres")
	}
	admin, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	defer admin.Close(ctx)
	db := fmt.Sprintf("idem_sqllint_%d", os.Getpid())
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+db); err != nil {
		return err
	}
	defer admin.Exec(context.Background(), "DROP DATABASE IF EXISTS "+db+" WITH (FORCE)")
	cfg, _ := pgx.ParseConfig(url)
	cfg.Database = db
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	if err := idemsql.Migrate(ctx, conn, idemsql.Options{}); err != nil {
		return err
	}
	if _, err := conn.Exec(ctx, "CREATE EXTENSION IF NOT EXISTS plpgsql_check"); err != nil {
		return fmt.Errorf("%w\nthe plpgsql_check extension is missing: apt-get install postgresql-15-plpgsql-check", err)
	}
	rows, err := conn.Query(ctx, `
		SELECT p.oid::regprocedure::text, c.lineno, c.level, c.message, coalesce(c.detail, ''), coalesce(c.hint, '')
		  FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang AND l.lanname = 'plpgsql',
		       LATERAL plpgsql_check_function_tb(p.oid, fatal_errors => false, performance_warnings => true,
		                                          extra_warnings => true, security_warnings => true) c
		 WHERE p.pronamespace = 'idem'::regnamespace
		 ORDER BY 1, 2`)
	if err != nil {
		return err
	}
	var findings, functions int
	for rows.Next() {
		var fn, level, msg, detail, hint string
		var line *int
		if err := rows.Scan(&fn, &line, &level, &msg, &detail, &hint); err != nil {
			return err
		}
		l := 0
		if line != nil {
			l = *line
		}
		fmt.Printf("%s:%d: %s: %s %s %s\n", fn, l, level, msg, detail, hint)
		findings++
	}
	if err := rows.Err(); err != nil {
		return err
	}
	if err := conn.QueryRow(ctx, `SELECT count(*) FROM pg_proc WHERE pronamespace = 'idem'::regnamespace
		AND prolang = (SELECT oid FROM pg_language WHERE lanname = 'plpgsql')`).Scan(&functions); err != nil {
		return err
	}
	if functions == 0 {
		return fmt.Errorf("no PL/pgSQL functions found in schema idem")
	}
	if findings > 0 {
		return fmt.Errorf("plpgsql_check: %d findings in %d functions", findings, functions)
	}
	fmt.Printf("plpgsql_check: %d functions, no findings\n", functions)
	return nil
}
