package org.flowerbed.app;

import android.content.Context;
import android.content.SharedPreferences;
import android.security.keystore.KeyGenParameterSpec;
import android.security.keystore.KeyProperties;
import java.security.GeneralSecurityException;
import java.security.KeyStore;
import java.io.IOException;
import javax.crypto.KeyGenerator;
import javax.crypto.SecretKey;
import org.flowerbed.phone.EnrolmentUri;
import org.flowerbed.phone.TokenSealer;

/**
 * The enrolment (gateway URL, phone name, certificate pin) in preferences and the token sealed by
 * core's {@link TokenSealer} under an AES key that lives in the Android Keystore and cannot be
 * exported. Nothing in preferences can be used without this phone's Keystore.
 */
final class KeystoreTokens {
  private static final String PREFS = "flowerbed-enrolment";
  private static final String KEY_ALIAS = "flowerbed-token";

  /** What the worker needs to reach the gateway. */
  static final class Enrolment {
    final String gateway;
    final String phone;
    final String pin;
    final String token;

    Enrolment(String gateway, String phone, String pin, String token) {
      this.gateway = gateway;
      this.phone = phone;
      this.pin = pin;
      this.token = token;
    }
  }

  private KeystoreTokens() {}

  /** Keep an enrolment: the token sealed, the rest in plain preferences. */
  static void save(Context context, EnrolmentUri e) throws GeneralSecurityException, IOException {
    String sealed = new TokenSealer(key()).seal(e.token, e.phone);
    context
        .getSharedPreferences(PREFS, Context.MODE_PRIVATE)
        .edit()
        .putString("gateway", e.gateway)
        .putString("phone", e.phone)
        .putString("pin", e.pin)
        .putString("sealed_token", sealed)
        .apply();
  }

  /** The stored enrolment, or null if the phone was never enrolled. */
  static Enrolment load(Context context) throws GeneralSecurityException, IOException {
    SharedPreferences p = context.getSharedPreferences(PREFS, Context.MODE_PRIVATE);
    String sealed = p.getString("sealed_token", null);
    String phone = p.getString("phone", null);
    if (sealed == null || phone == null) {
      return null;
    }
    String token = new TokenSealer(key()).open(sealed, phone);
    return new Enrolment(p.getString("gateway", null), phone, p.getString("pin", null), token);
  }

  /** Forget the enrolment (the key stays for the next one). */
  static void clear(Context context) {
    context.getSharedPreferences(PREFS, Context.MODE_PRIVATE).edit().clear().apply();
  }

  private static SecretKey key() throws GeneralSecurityException, IOException {
    KeyStore ks = KeyStore.getInstance("AndroidKeyStore");
    ks.load(null);
    KeyStore.Entry entry = ks.getEntry(KEY_ALIAS, null);
    if (entry instanceof KeyStore.SecretKeyEntry) {
      return ((KeyStore.SecretKeyEntry) entry).getSecretKey();
    }
    KeyGenerator g = KeyGenerator.getInstance(KeyProperties.KEY_ALGORITHM_AES, "AndroidKeyStore");
    g.init(
        new KeyGenParameterSpec.Builder(
                KEY_ALIAS, KeyProperties.PURPOSE_ENCRYPT | KeyProperties.PURPOSE_DECRYPT)
            .setBlockModes(KeyProperties.BLOCK_MODE_GCM)
            .setEncryptionPaddings(KeyProperties.ENCRYPTION_PADDING_NONE)
            .setKeySize(256)
            // TokenSealer draws its own random IV: allow a caller-provided one.
            .setRandomizedEncryptionRequired(false)
            .build());
    return g.generateKey();
  }
}
