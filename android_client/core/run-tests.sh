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

rm -rf build
mkdir -p build/classes build/test-classes

echo "compiling core (javac --release 8)"
find src/main/java -name '*.java' | sort >build/main-sources.txt
javac --release 8 -encoding UTF-8 -Xlint:all -Werror -d build/classes @build/main-sources.txt

echo "building build/flowerbed-phone.jar"
jar --create --file build/flowerbed-phone.jar --main-class org.flowerbed.phone.PhoneMain \
  -C build/classes .

echo "compiling tests"
find src/test/java -name '*.java' | sort >build/test-sources.txt
javac --release 8 -encoding UTF-8 -Xlint:all -Xlint:-options \
  -cp "build/flowerbed-phone.jar:$JUNIT" -d build/test-classes @build/test-sources.txt

echo "running JUnit"
classes=$(cd build/test-classes && find . -name '*Test.class' ! -name '*$*' | sort |
  sed -e 's|^\./||' -e 's|\.class$||' -e 's|/|.|g')
# shellcheck disable=SC2086  # one argument per test class
java -cp "build/test-classes:build/flowerbed-phone.jar:$JUNIT:$HAMCREST" \
  org.flowerbed.phone.JUnitMain $classes

echo "checking the jar starts"
java -jar build/flowerbed-phone.jar --help >/dev/null
echo "built $(pwd)/build/flowerbed-phone.jar"
