// Command migrate is the shop's migrate step, run by the database's owner once per release,
// before the shop starts: schema idem (idempotent: safe to run again), then the shop's own
// table, granted to the shop's login role (SHOP_APP_ROLE, default shop_app, a member of
// idem_app), not to idem_app: every member of idem_app, the login role of every other service
// of the cluster that uses idem, would get it.
//
//	DATABASE_URL=postgres://shop_owner@localhost/shop SHOP_APP_ROLE=shop_app go run ./migrate
package main

import (
	"cmp"
	"context"
	"log"
	"os"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/idem/idemmigrate"
)

func main() {
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer conn.Close(ctx)
	if err := idemmigrate.Migrate(ctx, conn, idemmigrate.Options{}); err != nil {
		log.Fatal(err) // a missing role says which superuser step is missing
	}
	app := pgx.Identifier{cmp.Or(os.Getenv("SHOP_APP_ROLE"), "shop_app")}.Sanitize()
	if _, err := conn.Exec(ctx, `CREATE TABLE IF NOT EXISTS orders (
		id bigserial PRIMARY KEY, customer text NOT NULL, sku text NOT NULL, qty int NOT NULL CHECK (qty > 0));
		GRANT SELECT, INSERT ON orders TO `+app+`;
		GRANT USAGE ON SEQUENCE orders_id_seq TO `+app); err != nil {
		log.Fatal(err)
	}
	log.Print("migrated")
}
