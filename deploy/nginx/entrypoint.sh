#!/bin/sh
# Like the official nginx image's entrypoint, for this Debian build: source
# /docker-entrypoint.d/*.envsh, render /etc/nginx/templates/*.template into /etc/nginx/conf.d/
# with envsubst (set variables only, so nginx's own $variables stay), then run the command.
set -eu
for script in /docker-entrypoint.d/*.envsh; do
  [ -e "$script" ] || continue
  . "$script"
done
if [ -d /etc/nginx/templates ]; then
  vars=$(env | cut -d= -f1 | sed 's/^/$/' | tr '\n' ' ')
  for template in /etc/nginx/templates/*.template; do
    [ -e "$template" ] || continue
    name=$(basename "$template" .template)
    envsubst "$vars" < "$template" > "/etc/nginx/conf.d/$name"
  done
fi
exec "$@"
