#!/usr/bin/env bash
# Build and test the flowerbed phone core offline, from a clean state:
#   javac --release 8 (no Android imports, runs on Android and any JVM 8+),
#   JUnit 4 console run with its summary line, then build/flowerbed-phone.jar.
# Installs Java and JUnit from Debian packages if they are missing (needs root).
# Exit status is non-zero if anything fails to build or any test fails.
set -euo pipefail
cd "$(dirname "$0")"

JUNIT=/usr/share/java/junit4.jar
HAMCREST=/usr/share/java/hamcrest-core.jar

missing=()
command -v javac >/dev/null 2>&1 || missing+=(default-jdk-headless)
command -v jar >/dev/null 2>&1 || missing+=(default-jdk-headless)
[ -f "$JUNIT" ] && [ -f "$HAMCREST" ] || missing+=(junit4)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "missing packages: ${missing[*]}; install them with: sudo apt-get install -y ${missing[*]}" >&2
    exit 1
  fi
  echo "installing ${missing[*]} from Debian"
  apt-get update -q
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}"
fi

# Each run compiles into a fresh directory of its own, so it starts from a clean state and a
# concurrent run (or a JVM phone using the jar) is not disturbed; the tested jar replaces
# build/flowerbed-phone.jar in one rename at the end.
mkdir -p build
work=$(mktemp -d "$(pwd)/build/run.XXXXXX")
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/classes" "$work/test-classes"

echo "compiling core (javac --release 8)"
find src/main/java -name '*.java' | sort >"$work/main-sources.txt"
javac --release 8 -encoding UTF-8 -Xlint:all -Werror -d "$work/classes" @"$work/main-sources.txt"

echo "building the jar"
jar --create --file "$work/flowerbed-phone.jar" --main-class org.flowerbed.phone.PhoneMain \
  -C "$work/classes" .

echo "compiling tests"
find src/test/java -name '*.java' | sort >"$work/test-sources.txt"
javac --release 8 -encoding UTF-8 -Xlint:all -Xlint:-options \
  -cp "$work/flowerbed-phone.jar:$JUNIT" -d "$work/test-classes" @"$work/test-sources.txt"

echo "running JUnit"
classes=$(cd "$work/test-classes" && find . -name '*Test.class' ! -name '*$*' | sort |
  sed -e 's|^\./||' -e 's|\.class$||' -e 's|/|.|g')
# shellcheck disable=SC2086  # one argument per test class
java -cp "$work/test-classes:$work/flowerbed-phone.jar:$JUNIT:$HAMCREST" \
  org.flowerbed.phone.JUnitMain $classes

echo "checking the jar starts"
java -jar "$work/flowerbed-phone.jar" --help >/dev/null
mv -f "$work/flowerbed-phone.jar" build/flowerbed-phone.jar
echo "built $(pwd)/build/flowerbed-phone.jar"
