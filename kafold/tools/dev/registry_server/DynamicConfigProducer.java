package io.kafold.dev.registry;

import io.apicurio.common.apps.config.DynamicConfigPropertyList;
import java.util.List;
import javax.enterprise.context.ApplicationScoped;
import javax.enterprise.inject.Produces;
import javax.inject.Singleton;

/** Stands in for Apicurio's config-index build extension (its deployment jar is not on Maven Central): no dynamic
 *  (admin-editable) settings, which a throwaway dev/test registry does not need. */
@ApplicationScoped
public class DynamicConfigProducer {
    @Produces
    @Singleton
    DynamicConfigPropertyList dynamicConfigPropertyList() {
        return new DynamicConfigPropertyList(List.of());
    }
}
